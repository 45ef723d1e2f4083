"""wedlm-serve's scoring side: the tokenizer endpoints lm-eval's remote tokenizer probes
(/tokenizer_info, /tokenize, /detokenize, in vLLM's shapes), chat `logprobs` / `top_logprobs`, and
scoring batched across requests on the engine thread with one bad job failing alone."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from decode.serving import serve  # noqa: E402
from decode.serving.scoring import score  # noqa: E402
from tests.serve_cases import CAPACITY, decoded_alone  # noqa: E402


def _post(s, path, body):
    return httpx.post(s["url"] + path, json=body, timeout=30)


def test_tokenizer_endpoints(server):
    s, tok = server, server["tokenizer"]
    info = httpx.get(s["url"] + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tok.eos_token == "<|im_end|>"
    assert info["bos_token"] is None and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == CAPACITY and info["vocab_size"] == s["config"].vocab_size
    text = "count with me: one, two"
    r = _post(s, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CAPACITY
    assert _post(s, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    msgs = [{"role": "user", "content": "hello there"}]
    r = _post(s, "/tokenize", {"messages": msgs}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(msgs))
    r = _post(s, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(msgs, False))
    # bad input: 400 naming the field
    for path, body, param, words in [
        ("/tokenize", {}, "prompt", "'prompt' (a string) or 'messages' is required"),
        ("/tokenize", {"prompt": 5}, "prompt", "'prompt' must be a string"),
        ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt", "not both"),
        ("/detokenize", {"tokens": [1, 2, 10 ** 12]}, "tokens", "token 2 is 1000000000000"),
        ("/detokenize", {"tokens": "abc"}, "tokens", "list of integer token ids"),
        ("/detokenize", {}, "tokens", "'tokens' is required"),
    ]:
        r = _post(s, path, body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (body, err)


def test_lm_evals_remote_tokenizer_reads_this_server(server):
    """lm-eval's own RemoteTokenizer and its support probe, pointed at this server."""
    lm_utils = pytest.importorskip("lm_eval.utils")
    s, tok = server, server["tokenizer"]
    base = s["url"] + "/v1/completions"
    assert lm_utils.check_remote_tokenizer_support(base)
    remote = lm_utils.RemoteTokenizer(base)
    text = "the cat sat on"
    assert remote.encode(text) == tok.encode(text)
    assert remote.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert remote.eos_token_id == tok.token_id("<|im_end|>")


def test_chat_logprobs_are_the_decodings(server):
    """Chat logprobs of a streaming server: the log-probabilities the decoding carried (the
    static batch's, checked against the step trace in tests/test_logprobs.py), greedy tokens
    first among their 3 alternatives; the AR reading of the finished text differs."""
    s, tok = server, server["tokenizer"]
    msgs = [{"role": "user", "content": "count with me"}]
    r = s["client"].chat.completions.create(model="tiny", messages=msgs, max_tokens=6, logprobs=True,
                                            top_logprobs=3, extra_body={"tau": 0.4})
    ids = tok.encode(tok.apply_chat_template(msgs))
    out, want = decoded_alone(s, ids, 6, with_logprobs=True)
    assert r.choices[0].message.content == tok.decode(out)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in out]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    np.testing.assert_allclose([c.logprob for c in content], want, atol=1e-5)
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-5
        assert [a.logprob for a in c.top_logprobs] == sorted((a.logprob for a in c.top_logprobs), reverse=True)
    ar_view = score(s["params"], s["config"], [ids + out])[0]["token_logprobs"][len(ids):]
    assert np.max(np.abs(np.asarray(ar_view) - np.asarray(want))) > 1e-4
    plain = s["client"].chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    assert plain.choices[0].logprobs is None
    for body, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),   # --max-logprobs 5
                        ({"top_logprobs": 2}, "top_logprobs"),
                        ({"logprobs": 1}, "logprobs"),
                        ({"logprobs": True, "stream": True}, "logprobs")]:
        r = _post(s, "/v1/chat/completions", dict({"model": "tiny", "messages": msgs}, **body))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_engine_batches_scoring_jobs_and_a_bad_one_fails_alone():
    calls = []

    def scorer(seqs, top_n):
        calls.append((len(seqs), top_n))
        if any(-1 in q for q in seqs):
            raise ValueError("token id -1 is outside the vocabulary")
        return [{"n": len(q), "top": top_n} for q in seqs]

    engine = serve.EngineThread(batcher=None, max_pending=4, scorer=scorer, score_batch=4)
    got = {}
    jobs = [("a", [[1, 2]], 0), ("b", [[1], [2, 3]], 0), ("c", [[4]], 0), ("d", [[5, 6, 7]], 0),
            ("e", [[8]], 2)]
    for name, seqs, top_n in jobs:
        engine.score(seqs, top_n, lambda r, name=name: got.__setitem__(name, r))
    engine._run_scores()
    assert calls == [(4, 0), (1, 0), (1, 2)]          # a+b+c share one forward; d alone; e's top_n apart
    assert got["b"] == [{"n": 1, "top": 0}, {"n": 2, "top": 0}] and got["d"] == [{"n": 3, "top": 0}]
    assert got["e"] == [{"n": 1, "top": 2}]
    calls.clear()
    got.clear()
    for name, seqs in [("a", [[1]]), ("bad", [[2, -1]]), ("c", [[3]])]:
        engine.score(seqs, 0, lambda r, name=name: got.__setitem__(name, r))
    engine._run_scores()
    assert calls == [(3, 0), (1, 0), (1, 0), (1, 0)]   # the batch failed: each job again, alone
    assert got["a"] == [{"n": 1, "top": 0}] and got["c"] == [{"n": 1, "top": 0}]
    assert isinstance(got["bad"], ValueError) and "-1" in str(got["bad"])


def test_a_prompt_far_beyond_the_context_is_refused_by_a_prefix(server):
    """A multi-megabyte prompt is judged by a bounded prefix (protocol.encode_within): a 400
    context_length_exceeded without tokenizing the whole text; a prompt that fits is tokenized
    whole."""
    from decode.serving import protocol
    tok = server["tokenizer"]

    class Spy:
        def __init__(self):
            self.longest = 0

        def encode(self, text):
            self.longest = max(self.longest, len(text))
            return tok.encode(text)
    spy = Spy()
    big = "the cat sat on the mat " * 200_000            # 4.6 MB
    with pytest.raises(protocol.APIError) as e:
        protocol.encode_within(spy, big, CAPACITY)
    assert e.value.code == "context_length_exceeded" and e.value.status == 400
    assert spy.longest <= protocol.CHARS_PER_TOKEN_BOUND * (CAPACITY + 2)
    fits = "the cat sat " * 20
    assert protocol.encode_within(spy, fits, CAPACITY) == tok.encode(fits)
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": big, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(server["url"] + "/health", timeout=30).status_code == 200
