"""wedlm-serve with the official `openai` client: the real app on 127.0.0.1 (uvicorn
in a thread; a subprocess for SIGTERM and the API key), a tiny random model and a tiny BPE tokenizer.
Greedy answers are checked against `decode.static.static_batch.generate()` on the prompt alone."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from decode.serving import serve  # noqa: E402
from decode.text import load_tokenizer  # noqa: E402
from tests.live_server import start_subprocess_server  # noqa: E402
from tests.serve_cases import CAPACITY, SLOTS, TAU, WINDOW, decoded_alone  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _health(s):
    return httpx.get(s["url"] + "/health", timeout=10).json()


def test_completion_chat_and_models(server):
    s, tok = server, server["tokenizer"]
    c = s["client"]
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="count with me: one, two", max_tokens=20)
    ids = tok.encode("count with me: one, two")
    want = decoded_alone(s, ids, 20)
    assert r.choices[0].text == tok.decode(want)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 20, len(ids) + 20)
    # chat: the checkpoint's template; WeDLM settings in the body
    msgs = [{"role": "user", "content": "hello there"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, extra_body={"tau": 0.9, "lam": 0.1})
    ids = tok.encode(tok.apply_chat_template(msgs))
    want = decoded_alone(s, ids, 12, tau=0.9, lam=0.1)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(want)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12


def test_streaming_matches_and_ends_with_done(server):
    s, tok = server, server["tokenizer"]
    ids = tok.encode("the cat sat on the mat")
    want = tok.decode(decoded_alone(s, ids, 40))
    pieces, reasons, usage = [], [], None
    for ch in s["client"].completions.create(model="tiny", prompt=ids, max_tokens=40, stream=True,
                                             stream_options={"include_usage": True}):
        if ch.choices:
            pieces.append(ch.choices[0].text)
            reasons.append(ch.choices[0].finish_reason)
        if ch.usage is not None:
            usage = ch.usage
    assert "".join(pieces) == want and reasons[-1] == "length" and usage.completion_tokens == 40
    assert len([p for p in pieces if p]) > 1          # more than one chunk of text
    # the raw event stream: OpenAI chunks, then data: [DONE]
    msgs = [{"role": "user", "content": "one two"}]
    with httpx.stream("POST", s["url"] + "/v1/chat/completions", timeout=30,
                      json={"model": "tiny", "messages": msgs, "max_tokens": 16, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == tok.decode(decoded_alone(s, tok.encode(tok.apply_chat_template(msgs)), 16))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_strings(server):
    s, tok = server, server["tokenizer"]
    ids = tok.encode("count with me: one, two")
    full = tok.decode(decoded_alone(s, ids, 60))
    assert len(full) > 8
    stop = full[5:8]   # a string the greedy continuation contains (multi-character)
    cut = full[:full.find(stop)]
    r = s["client"].completions.create(model="tiny", prompt=ids, max_tokens=60, stop=[stop, "\u2603never"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 60
    stats = r.model_extra["wedlm"]             # the statistics, as on every other answer
    assert stats["steps"] >= 1 and stats["token_slots"] >= stats["steps"] and stats["p_cache"] > 0
    chunks = list(s["client"].completions.create(model="tiny", prompt=ids, max_tokens=60, stop=stop,
                                                 stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cut
    last = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason][-1]
    assert last.choices[0].finish_reason == "stop" and last.model_extra["wedlm"]["steps"] >= 1
    deadline = time.time() + 10        # the cancelled request leaves its slot
    while _health(s)["pending"] and time.time() < deadline:
        time.sleep(0.05)
    assert _health(s)["pending"] == 0


def test_every_door_cuts_the_same_output_the_same_way(server, ckpt, tmp_path, capsys):
    """One stop-string handler (decode.text.TextStream): the server (plain and streamed),
    wedlm-decode and its batch job give the same text, cut before the same stop string, with the
    same finish reason and token count."""
    from decode import cli
    s, tok = server, server["tokenizer"]
    prompt = "count with me: one, two"
    full = tok.decode(decoded_alone(s, tok.encode(prompt), 40))
    stop = full[6:9]
    want = full[:full.find(stop)]
    r = s["client"].completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=[stop])
    streamed = "".join(ch.choices[0].text for ch in s["client"].completions.create(
        model="tiny", prompt=prompt, max_tokens=40, stop=[stop], stream=True) if ch.choices)
    common = ["--checkpoint", ckpt[0], "--window", str(WINDOW), "--tau", str(TAU),
              "--no-default-stops", "--stop", stop, "--capacity", str(CAPACITY)]
    assert cli.main(common + ["--prompt", prompt, "--max-new-tokens", "40", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": 0, "prompt": prompt, "max_tokens": 40}) + "\n")
    assert cli.main(common + ["--input", str(src), "--output", str(out), "--slots", "1"]) == 0
    job = json.loads(out.read_text())
    assert r.choices[0].text == streamed == row["text"] == job["text"] == want
    assert r.choices[0].finish_reason == row["finish"] == job["finish_reason"] == "stop"
    assert r.usage.completion_tokens == len(row["ids"]) == job["completion_tokens"]


def test_echo_and_logprobs_score_through_the_engine(server):
    """`echo` + `logprobs` + `max_tokens: 0` scores a batch of prompts (one choice each, in order)
    with the AR reading, as decode.serving.scoring does (itself equal to transformers, tests/test_scoring.py);
    with generation the completion's log-probabilities are those its decoding carried (the static
    batch's, tests/test_logprobs.py checks those against the trace); bad combinations are 400s
    naming the field."""
    from decode.serving.scoring import score
    s, tok = server, server["tokenizer"]
    a, b = tok.encode("count with me: one, two"), tok.encode("the cat sat on")
    r = s["client"].completions.create(model="tiny", prompt=[a, b], max_tokens=0, echo=True,
                                       logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for ids, c in zip((a, b), r.choices):
        want = score(s["params"], s["config"], [ids], top_n=2)[0]
        lp = c.logprobs
        assert c.text == tok.decode(ids) and c.finish_reason == "length"
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], want["token_logprobs"][1:], atol=1e-5)
        assert [len(d) for d in lp.top_logprobs[1:]] == [2] * (len(ids) - 1)
        assert "".join(lp.tokens) == c.text
        assert lp.text_offset == [len(tok.decode(ids[:j])) for j in range(len(ids))]
    assert r.usage.prompt_tokens == len(a) + len(b) and r.usage.completion_tokens == 0
    g = s["client"].completions.create(model="tiny", prompt=a, max_tokens=5, logprobs=0,
                                       extra_body={"tau": TAU})
    out, want = decoded_alone(s, a, 5, with_logprobs=True)
    assert g.choices[0].text == tok.decode(out)
    np.testing.assert_allclose(g.choices[0].logprobs.token_logprobs, want, atol=1e-5)
    assert g.choices[0].logprobs.top_logprobs is None
    # a stop string cancels the request; its tokens' log-probabilities still come back
    j = next(j for j in range(1, len(out))             # the first token whose text is new there
             if tok.decode(out[j:j + 1]).strip() and tok.decode(out[j:j + 1]) not in tok.decode(out[:j]))
    st = s["client"].completions.create(model="tiny", prompt=a, max_tokens=5, logprobs=0,
                                        stop=[tok.decode(out[j:j + 1])], extra_body={"tau": TAU})
    lp = st.choices[0].logprobs
    assert st.choices[0].finish_reason == "stop" and j <= len(lp.token_logprobs) <= j + 1
    np.testing.assert_allclose(lp.token_logprobs, want[:len(lp.token_logprobs)], atol=1e-5)
    # echo with generation: the prompt's AR reading, then the completion's carried values
    e = s["client"].completions.create(model="tiny", prompt=a, max_tokens=5, logprobs=1, echo=True,
                                       extra_body={"tau": TAU})
    lp = e.choices[0].logprobs
    prompt_want = score(s["params"], s["config"], [a], top_n=1)[0]["token_logprobs"]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(a) + 5
    np.testing.assert_allclose(lp.token_logprobs[1:len(a)], prompt_want[1:], atol=1e-5)
    np.testing.assert_allclose(lp.token_logprobs[len(a):], want, atol=1e-5)
    assert [len(d) for d in lp.top_logprobs[1:]] == [1] * (len(a) + 4)
    r = httpx.post(s["url"] + "/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 3, "logprobs": 6}, timeout=30)
    assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
    bad = lambda **body: httpx.post(s["url"] + "/v1/completions", json=dict(
        {"model": "tiny", "prompt": "hi"}, **body), timeout=30)
    r = bad(logprobs=21)
    assert r.status_code == 400 and "'logprobs' is at most 20" in r.json()["error"]["message"]
    r = bad(echo=True, stream=True, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = bad(prompt=[[1, 2]] * 65, max_tokens=0, echo=True)
    assert r.status_code == 400 and "at most 64 per request" in r.json()["error"]["message"]
    r = bad(prompt=[[1, 2], [3, 4, 999]], max_tokens=0, echo=True)
    assert r.status_code == 400 and "prompt 1 of the batch" in r.json()["error"]["message"]
    assert "token id 999 is outside the vocabulary" in r.json()["error"]["message"]
    r = bad(max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_24_concurrent_mixed_requests_equal_alone(server):
    s = server
    rng = random.Random(13)
    vocab = s["config"].vocab_size - 1
    jobs = []
    for i in range(24):
        plen = [3, 200][i] if i < 2 else rng.randint(3, 200)
        mt = [300, 1][i % 2] if i < 4 else rng.randint(1, 300)
        prompt = [rng.randrange(vocab) for _ in range(plen)]
        kw = dict(tau=rng.choice([0.0, 0.4, 1.5]), lam=rng.choice([0.0, 0.02, 0.2]))
        if 16 <= i < 20:   # sampled; requests 20-23 repeat them (same prompt, settings and seed)
            kw.update(temperature=0.9, top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.8]), seed=100 + i)
        jobs.append(jobs[i - 4] if i >= 20 else (prompt, mt, kw))

    def one(job):
        prompt, mt, kw = job
        extra = {k: kw[k] for k in ("tau", "lam", "top_k") if k in kw}
        r = s["client"].completions.create(model="tiny", prompt=prompt, max_tokens=mt, extra_body=extra,
                                           temperature=kw.get("temperature", 0.0), top_p=kw.get("top_p", 1.0),
                                           seed=kw.get("seed"))
        return r.choices[0].text, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(24) as ex:
        got = list(ex.map(one, jobs))
    tok = s["tokenizer"]
    for i, ((prompt, mt, kw), (text, n)) in enumerate(zip(jobs, got)):
        if "temperature" in kw:
            continue
        want = decoded_alone(s, prompt, mt, **kw)
        assert (text, n) == (tok.decode(want), len(want)), f"request {i}: prompt {len(prompt)}, max_tokens {mt}, {kw}"
    for i in range(16, 20):
        assert got[i] == got[i + 4], f"sampled request {i} does not repeat for the same seed"
    assert _health(s)["active"] == 0


def _one_step(gate):
    """Let the gated engine run exactly one step (bounded wait)."""
    n = gate.steps
    gate.sem.release()
    deadline = time.time() + 10
    while gate.steps == n and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)   # callbacks reach the event loop


def _freed_at_the_next_step(s, gate, cancelled_before):
    """After a client hung up (and the server had time to notice): its request is cancelled and
    its slot freed within one more step of the gated engine."""
    at_close = gate.steps
    for _ in range(3):
        if _health(s)["finished"]["cancelled"] == cancelled_before + 1:
            break
        _one_step(gate)
    h = _health(s)
    assert h["finished"]["cancelled"] == cancelled_before + 1 and h["active"] == 0 and h["pending"] == 0
    assert gate.steps - at_close <= 1                 # freed at the next step boundary


def test_disconnect_frees_the_slot_within_a_chunk(server):
    s, gate = server, server["gate"]
    before = _health(s)["finished"]["cancelled"]
    got_text = threading.Event()

    def reader():   # reads until the first text arrives, then hangs up
        with httpx.stream("POST", s["url"] + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 300, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    got_text.set()
                    return

    gate.close()
    try:
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        deadline = time.time() + 10
        while _health(s)["pending"] < 1 and time.time() < deadline:
            time.sleep(0.02)
        for _ in range(40):
            if got_text.is_set():
                break
            _one_step(gate)
        t.join(10)
        assert got_text.is_set() and not t.is_alive()
        assert _health(s)["active"] == 1                  # still decoding: max_tokens is far away
        time.sleep(0.3)                                   # the server sees the hang-up
        _freed_at_the_next_step(s, gate, before)
    finally:
        gate.open()
    r = s["client"].completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert r.usage.completion_tokens == 5       # the server goes on


def test_non_streaming_client_that_leaves_frees_its_slot(server):
    """A non-streaming client that hangs up (its own timeout) while its request decodes: the
    request is cancelled and its slot freed at the next step boundary after the server notices,
    as for a streaming client; the server goes on."""
    s, gate = server, server["gate"]
    before = _health(s)["finished"]["cancelled"]
    left = threading.Event()

    def impatient():
        try:
            httpx.post(s["url"] + "/v1/completions", timeout=1.0,
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 300})
        except httpx.TimeoutException:
            left.set()

    gate.close()
    try:
        t = threading.Thread(target=impatient, daemon=True)
        t.start()
        deadline = time.time() + 10
        while _health(s)["pending"] + _health(s)["active"] < 1 and time.time() < deadline:
            time.sleep(0.02)
        _one_step(gate)                                   # admitted and decoding
        assert _health(s)["active"] == 1
        t.join(10)
        assert left.is_set()
        time.sleep(1.2)                                   # the server polls every 0.5 s
        _freed_at_the_next_step(s, gate, before)
    finally:
        gate.open()
    r = s["client"].completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert r.usage.completion_tokens == 5       # the server goes on


def test_busy_request_of_a_client_that_leaves_is_cancelled_promptly(server):
    """A non-streaming client hangs up while its request keeps producing tokens (the engine runs
    freely, a little slower than the tiny model would, as a busy device does): the request is
    cancelled and its slot freed within a second, long before it would have finished."""
    s, gate = server, server["gate"]
    before = _health(s)["finished"]
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": CAPACITY - 3,
                       "temperature": 0}).encode()
    host, port = s["url"].removeprefix("http://").split(":")
    gate.delay = 0.02           # <= 50 steps a second: tokens keep coming, far apart from 0.5 s
    try:
        client = socket.create_connection((host, int(port)), timeout=10)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                       b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.time() + 30
        while _health(s)["active"] < 1 and time.time() < deadline:   # admitted (compiled)
            time.sleep(0.02)
        start = _health(s)["steps"]
        while _health(s)["steps"] < start + 10 and time.time() < deadline:
            time.sleep(0.02)
        at_leave = _health(s)
        assert at_leave["active"] == 1                      # decoding, 10 steps in
        client.close()                                      # the client hangs up
        deadline = time.time() + 1.0
        while _health(s)["active"] and time.time() < deadline:
            time.sleep(0.02)
        after = _health(s)
        assert after["active"] == 0 and after["pending"] == 0
        assert after["finished"]["cancelled"] == before["cancelled"] + 1
        assert after["finished"]["length"] == before["length"]   # cut, not finished
    finally:
        gate.delay = 0.0
    r = s["client"].completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert r.usage.completion_tokens == 5       # the server goes on


BAD = [
    ({"prompt": "hi"}, "model"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": 7}, "prompt"),
    ({"model": "tiny", "prompt": [1, 999]}, "prompt"),
    ({"model": "tiny", "prompt": [3] * (CAPACITY + 1)}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "tau": -0.1}, "tau"),
    ({"model": "tiny", "prompt": "hi", "lam": "big"}, "lam"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": "hi", "seed": 1.5}, "seed"),
    ({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}, "stop"),
    ({"model": "tiny", "prompt": "hi", "stop": 3}, "stop"),
    ({"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": "tiny", "prompt": "hi", "n": SLOTS + 1}, "n"),
    ({"model": "tiny", "prompt": "hi", "n": 2, "stream": True}, "n"),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "tiny", "prompt": "hi", "frequency_penalty": "x"}, "frequency_penalty"),
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "tiny", "prompt": "hi", "min_p": -0.1}, "min_p"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
]


def test_penalties_logit_bias_min_p_and_n_through_the_openai_client(server):
    """The OpenAI sampling fields reach the Decoder: each answer equals the request decoded
    alone with the same settings; `n` choices are the request with seeds seed, seed + 1, ..."""
    s, tok, c = server, server["tokenizer"], server["client"]
    ids = tok.encode("count with me: one, two")
    extra = dict(presence_penalty=1.5, frequency_penalty=2.0, logit_bias={"5": 9.0, "6": -4.0})
    r = c.completions.create(model="tiny", prompt="count with me: one, two", max_tokens=12,
                             extra_body={"repetition_penalty": 4.0, "min_p": 0.1}, **extra)
    want = decoded_alone(s, ids, 12, repetition_penalty=4.0, min_p=0.1, **extra)
    assert r.choices[0].text == tok.decode(want)
    assert want != decoded_alone(s, ids, 12)                       # the settings bite
    msgs = [{"role": "user", "content": "hello there"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=3, temperature=0.9,
                                  seed=4, extra_body={"min_p": 0.05})
    chat_ids = tok.encode(tok.apply_chat_template(msgs))
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for k, ch in enumerate(r.choices):
        assert ch.message.content == tok.decode(decoded_alone(s, chat_ids, 8, temperature=0.9,
                                                              seed=4 + k, min_p=0.05))
    assert r.usage.completion_tokens == 24
    r = c.completions.create(model="tiny", prompt=["one", "two"], max_tokens=4, n=2, seed=1,
                             temperature=0.8)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for i, text in enumerate(["one", "two"]):
        for k in range(2):
            want = decoded_alone(s, tok.encode(text), 4, temperature=0.8, seed=1 + k)
            assert r.choices[2 * i + k].text == tok.decode(want)


def test_bad_requests_get_400_naming_the_field(server):
    s = server
    steps = s["engine"].steps
    for body, field in BAD:
        r = httpx.post(s["url"] + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error" and err["message"], (body, err)
    for body, field in [({"model": "tiny"}, "messages"),
                        ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
                        ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0].role"),
                        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 3000}]}, "messages")]:
        r = httpx.post(s["url"] + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    for path, body in (("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "gpt-4", "messages": [
                           {"role": "user", "content": "hi"}]}),
                       ("/tokenize", {"model": "gpt-4", "prompt": "hi"})):
        r = httpx.post(s["url"] + path, json=body, timeout=10)     # OpenAI's and vLLM's 404
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found", (path, r.text)
        assert err["param"] == "model" and "`gpt-4` does not exist" in err["message"]
        assert "This server serves 'tiny'" in err["message"]
    r = httpx.post(s["url"] + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as e:
        s["client"].completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    h = _health(s)
    assert s["engine"].steps == steps and h["pending"] == 0 and h["status"] == "ok"  # never reached the engine


def test_an_unrecognized_field_is_a_400_naming_it_and_every_accepted_one_is_taken(server):
    """OpenAI's rule at both endpoints: a field the endpoint does not accept is refused by name
    (never silently ignored), before anything reaches the engine; every documented field is
    accepted (each with a value it takes)."""
    from decode.serving.protocol import EXTENSION_FIELDS, OPENAI_FIELDS
    s = server
    steps = s["engine"].steps
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for extra in ({"frobnicate": 1}, {"ignore_eos": True}, {"temprature": 0.5}):
            r = httpx.post(s["url"] + path, json=dict(base, model="tiny", max_tokens=4, **extra),
                           timeout=10)
            name = next(iter(extra))
            assert r.status_code == 400, (path, extra, r.text)
            err = r.json()["error"]
            assert err["param"] == name and err["code"] == "unknown_parameter", err
            assert f"unrecognized request argument supplied: {name!r}" in err["message"]
            assert "tau" in err["message"] and "temperature" in err["message"]
    assert s["engine"].steps == steps                      # refused before the engine
    taken = dict(model="tiny", max_tokens=3, stream=False, n=1, stop=["\u2603never"], temperature=0.0,
                 top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}, seed=1,
                 user="someone", tau=0.5, lam=0.02, top_k=0, min_p=0.0, repetition_penalty=1.0,
                 sampling_order="filter_first", stream_options=None)
    assert set(taken) - {"max_tokens"} <= set(OPENAI_FIELDS["completions"] + EXTENSION_FIELDS)
    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "serving.md")).read()
    assert all(f"`{name}`" in page for names in OPENAI_FIELDS.values() for name in names)
    assert all(f"`{name}`" in page for name in EXTENSION_FIELDS)
    r = httpx.post(s["url"] + "/v1/completions", json=dict(taken, prompt="hi"), timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(s["url"] + "/v1/chat/completions", json=dict(
        taken, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3,
        max_tokens=None, parallel_tool_calls=True), timeout=30)
    assert r.status_code == 200, r.text


def test_requests_that_used_to_break_the_server(server):
    """A top_k beyond int32 is a 400 naming it (it used to reach the engine thread and
    stop it); a body over the limit is a 413 before it is read; JSON nested past the parser's
    depth a 400; a named max_tokens that does not fit beside the prompt a 400
    context_length_exceeded (the server's default is cut to the room left instead); afterwards
    the same greedy prompt still answers as before and /health is ok."""
    s = server
    url = s["url"] + "/v1/completions"
    before = s["client"].completions.create(model="tiny", prompt="one two three", max_tokens=8).choices[0].text
    r = httpx.post(url, json={"model": "tiny", "prompt": "x", "top_k": 2**40}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    r = httpx.post(url, json={"model": "tiny", "prompt": "x", "seed": 2**40}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    r = httpx.post(url, content=b'{"model": "tiny", "prompt": "' + b"a" * (9 << 20) + b'"}', timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url, content=b"[" * 100000 + b"]" * 100000, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    ids = [3 + i % 100 for i in range(CAPACITY - 4)]
    r = httpx.post(url, json={"model": "tiny", "prompt": ids, "max_tokens": 10}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(url, json={"model": "tiny", "prompt": ids}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
    r = httpx.post(url, json={"model": "tiny", "prompt": [3 + i % 100 for i in range(CAPACITY)]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    after = s["client"].completions.create(model="tiny", prompt="one two three", max_tokens=8).choices[0].text
    assert after == before and _health(s)["status"] == "ok"


def test_429_beyond_the_queue(server):
    s, gate, engine = server, server["gate"], server["engine"]
    gate.close()
    limit, engine.max_pending = engine.max_pending, 2
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(s["client"].completions.create, model="tiny", prompt="one two", max_tokens=4)
                    for _ in range(2)]
            deadline = time.time() + 10
            while _health(s)["pending"] < 2 and time.time() < deadline:
                time.sleep(0.02)
            r = httpx.post(s["url"] + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            gate.open()
            assert [f.result(timeout=30).usage.completion_tokens for f in futs] == [4, 4]
    finally:
        engine.max_pending = limit
        gate.open()


def test_subprocess_api_key_and_sigterm(ckpt, tmp_path):
    path = ckpt[0]
    proc, url = start_subprocess_server(
        path, "--slots", "2", "--window", "4", "--capacity", "256", "--steps-per-call", "1",
        "--no-default-stops", "--lazy-compile", "--log-level", "warning",
        env={"WEDLM_API_KEY": "sekrit"})
    try:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(
                model="model", prompt="hi", max_tokens=2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0, timeout=60)
        stream = client.completions.create(model="model", prompt="count with me", max_tokens=200,
                                           stream=True, extra_body={"tau": 0.0})
        first = next(iter(stream))                # in flight when SIGTERM arrives
        proc.send_signal(signal.SIGTERM)
        rest = [ch for ch in stream]
        assert rest[-1].choices[0].finish_reason == "length"   # finished, not cut off
        assert proc.wait(timeout=60) == 0
        assert first.choices[0].text is not None
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sigterm_past_the_shutdown_timeout_answers_the_streams(ckpt):
    """Streams still running when --shutdown-timeout runs out end with an error event (503) and
    [DONE], never cut; the process exits 0 with no traceback."""
    path = ckpt[0]
    proc, url = start_subprocess_server(
        path, "--slots", "2", "--method", "ar", "--capacity", "2048", "--steps-per-call", "1",
        "--no-default-stops", "--lazy-compile", "--log-level", "warning", "--shutdown-timeout", "1")
    try:
        assert proc.poll() is None, proc.stdout.read().decode()
        body = {"model": "model", "prompt": "count with me", "max_tokens": 2000, "stream": True,
                "tau": 0.0, "lam": 0.0}
        warm = httpx.post(url + "/v1/completions", json=dict(body, stream=False, max_tokens=4),
                          timeout=120)
        assert warm.status_code == 200, warm.text    # programs compiled before the clock starts
        lines = [[] for _ in range(2)]

        def read(i):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines[i].append(line)
                        if len(lines[i]) == 1:
                            started.release()

        started = threading.Semaphore(0)
        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for t in readers:
            t.start()
        for _ in readers:
            assert started.acquire(timeout=60)
        proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(60)
        out = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        for got in lines:
            assert got[-1] == "data: [DONE]", got[-3:]
            last = json.loads(got[-2][len("data: "):])
            if "error" in last:                       # stopped by the timeout: told so
                assert last["error"]["code"] == "unavailable"
                assert "shutting down" in last["error"]["message"]
            else:                                     # or it finished in time
                assert last["choices"][0]["finish_reason"] == "length"
        assert any("error" in json.loads(g[-2][len("data: "):]) for g in lines), \
            "no stream outlived the 1 s timeout; the test decodes too little to tell"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_text_stream_never_emits_past_a_stop_string(ckpt):
    tok = load_tokenizer(ckpt[0])
    text = "hello world, hello there"
    ids = tok.encode(text)
    for stops, want in ([], text), (["o th"], "hello world, hell"), (["xyz", "ld, h"], "hello wor"):
        ts = serve.TextStream(tok, stops)
        out = ""
        for t in ids:
            out += ts.add([t])
            assert want.startswith(out)           # nothing past the cut ever leaves
            if ts.stopped:
                break
        out += ts.finish()
        assert out == want and ts.stopped == bool(stops)
        assert ts.n_used == (len(ids) if not stops else
                             min(k for k in range(1, len(ids) + 1) if any(s in tok.decode(ids[:k]) for s in stops)))
