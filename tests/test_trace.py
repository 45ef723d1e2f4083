"""The decoding picture: decode.static.trace over engine.trace_steps on a tiny random
model with a tiny byte-level BPE tokenizer, and `wedlm-decode --trace`."""

from __future__ import annotations

import json
import os
import re

import pytest

from decode import cli
from decode.config import DecodeConfig
from decode.static.static_batch import generate, trace_steps
from decode.text import load_tokenizer
from decode.static.trace import (STATES, TraceError, check_request, committed_ids, render_html,
                          trace_view, write_trace)
from wedlm_jax.config import ModelConfig
from wedlm_jax.checkpoints import save_hf_checkpoint
from tests.synthetic import random_params, tiny_bpe_tokenizer

CORPUS = ["one two three four five six seven eight nine ten", "the cat sat on the mat",
          "count with me: one, two, three", "hello world, hello there"] * 5
MASK = 127


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace")
    tok = tiny_bpe_tokenizer(CORPUS, ["<|endoftext|>"])
    config = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                         mask_token_id=MASK)
    params = random_params(config, seed=1, head_scale=40.0)
    path = save_hf_checkpoint(config, params, folder / "model", progress=False)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": None}, f)
    return path, config, params, load_tokenizer(path)


def _sections(doc: str) -> list[str]:
    return re.findall(r"<section class='step'.*?</section>", doc, flags=re.S)


def _committed_from_html(doc: str) -> list[list[int]]:
    return [[int(x) for x in re.findall(r"<td class='committed' data-id='(\d+)'", s)] for s in _sections(doc)]


@pytest.mark.parametrize("method,tau", [("streaming", 1.0), ("block", 1.0), ("ar", 0.4)])
def test_view_commits_equal_generate(ckpt, method, tau):
    path, config, params, tk = ckpt
    prompt = tk.encode("count with me: one, two")
    dc = DecodeConfig(method=method, window=4, tau=tau, lam=0.1, max_new_tokens=20)
    want = generate(params, config, [prompt], dc).tokens[0]
    trace, final = trace_steps(params, config, [prompt], dc)
    steps = trace_view(trace, final, 0, method)
    assert len(steps) == len(trace)
    assert committed_ids(steps) == want and len(want) == 20
    assert [st["commit"] for st in steps] == [int(a["commit"][0]) for a in trace]
    doc = render_html([dict(prompt="count with me: one, two", steps=steps)], tk)
    assert len(_sections(doc)) == len(steps)
    per_step = _committed_from_html(doc)
    assert sum(per_step, []) == want
    assert [len(c) for c in per_step] == [st["commit"] for st in steps]
    generated = re.search(r"<pre class='text generated'>(.*?)</pre>", doc, flags=re.S).group(1)
    import html
    assert html.unescape(generated) == tk.decode(want)
    if method == "block":  # a block commits whole or not at all
        assert {st["commit"] for st in steps} <= {0, 4}


@pytest.mark.parametrize("refill", ["before", "after"])
def test_streaming_states_are_consistent(ckpt, refill):
    """A slot filled at step k is fed (filled or committed, same token) at step k + 1; every state
    shows up; the forward never exceeds W slots (refill after) or 2W (before); physical order puts
    filled slots first."""
    path, config, params, tk = ckpt
    prompt = tk.encode("the cat sat")
    dc = DecodeConfig(window=4, tau=1.0, lam=0.05, max_new_tokens=24, refill=refill)
    most = 8 if refill == "before" else 4
    trace, final = trace_steps(params, config, [prompt], dc)
    steps = trace_view(trace, final, 0, "streaming")
    seen = {s["state"] for st in steps for s in st["slots"]}
    assert seen == set(STATES)
    for st, nxt in zip(steps, steps[1:]):
        assert len(st["slots"]) <= most and nxt["n"] == st["n"] + st["commit"]
        feed = {s["pos"]: s for s in nxt["slots"]}
        for s in st["slots"]:
            if s["state"] in ("new", "filled"):
                assert feed[s["pos"]]["state"] in ("filled", "committed")
                assert feed[s["pos"]]["token"] == s["token"]
            if s["state"] == "masked" and s["pos"] in feed:
                assert feed[s["pos"]]["state"] in ("masked", "new")
        n_filled = sum(s["state"] in ("committed", "filled") for s in st["slots"])
        assert sorted(s["phys"] for s in st["slots"] if s["state"] in ("committed", "filled")) == list(range(n_filled))
    # the first step sees only masks
    assert {s["state"] for s in steps[0]["slots"]} <= {"masked", "new"}


def test_cli_trace_html_and_png(ckpt, tmp_path, capsys):
    path, config, params, tk = ckpt
    out = tmp_path / "t.html"
    code = cli.main(["--checkpoint", path, "--prompt", "hello world", "--window", "4", "--tau", "1.5",
                     "--max-new-tokens", "10", "--json", "--trace", str(out)])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    doc = json.loads(cap.out)
    ids = doc["results"][0]["ids"]
    html_doc = out.read_text()
    assert len(_sections(html_doc)) == doc["total"]["steps"] == doc["trace"]["steps"][0]
    assert sum(_committed_from_html(html_doc), []) == ids
    png = tmp_path / "t.png"
    try:
        import matplotlib  # noqa: F401
        have_mpl = True
    except ImportError:
        have_mpl = False
    code = cli.main(["--checkpoint", path, "--prompt", "hello world", "--window", "4",
                     "--max-new-tokens", "6", "--trace", str(png)])
    cap = capsys.readouterr()
    if have_mpl:
        assert code == 0, cap.err
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    else:
        assert code == 2 and "matplotlib" in cap.err and not png.exists()


def test_bad_trace_requests(ckpt, tmp_path, capsys):
    path, config, params, tk = ckpt
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(f"prompt {i}") for i in range(5)) + "\n")
    cases = [
        (["--prompt", "a", "--trace", str(tmp_path / "t.svg")], "unknown extension '.svg'"),
        (["--prompt", "a", "--trace", str(tmp_path / "t")], "unknown extension"),
        (["--prompts-file", str(prompts), "--trace", str(tmp_path / "t.html")], "at most 4 prompts, got 5"),
        (["--prompts-file", str(prompts), "--trace", str(tmp_path / "t.png")], "at most 1 prompt, got 5"),
        (["--prompt", "a", "--method", "verified", "--trace", str(tmp_path / "t.html")], "not 'verified'"),
    ]
    for argv, msg in cases:
        code = cli.main(["--checkpoint", path, *argv])
        err = capsys.readouterr().err
        assert code == 2 and msg in err, (argv, err)
    assert not any(p.name.startswith("t") for p in tmp_path.iterdir())
    with pytest.raises(TraceError, match="at most 4"):
        check_request("x.html", "streaming", 5)
    assert check_request("x.HTM", "block", 4) == "html"
    with pytest.raises(TraceError, match="unknown extension"):
        write_trace(str(tmp_path / "x.txt"), [])
