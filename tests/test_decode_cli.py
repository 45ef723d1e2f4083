"""Text and CLI: wedlm-decode on a tiny checkpoint folder with a tiny BPE tokenizer
trained here with the `tokenizers` library, a chat template, and generation_config.json eos."""

from __future__ import annotations

import json
import os

import pytest

from decode import cli
from decode.config import DecodeConfig, DecodeConfigError
from decode.static.static_batch import generate
from decode.text import load_tokenizer, split_stop_strings, stop_at_strings
from wedlm_jax.config import ModelConfig
from wedlm_jax.checkpoints import save_hf_checkpoint
from tests.synthetic import random_params, tiny_bpe_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["one two three four five six seven eight nine ten", "the cat sat on the mat",
          "count with me: one, two, three", "hello world, hello there"] * 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tok = tiny_bpe_tokenizer(CORPUS, SPECIALS)
    vocab = tok.get_vocab_size()
    assert vocab <= 127
    config = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                         mask_token_id=127, eos_token_id=tok.token_to_id("<|endoftext|>"))
    params = random_params(config, seed=0, head_scale=20.0)
    path = save_hf_checkpoint(config, params, folder / "model", progress=False)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT, "eos_token": "<|im_end|>", "bos_token": None}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.token_to_id("<|endoftext|>"), 5]}, f)
    return path, config, params


def _cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_equals_engine(ckpt, capsys):
    path, config, params = ckpt
    tk = load_tokenizer(path)
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "count with me: one, two",
                          "--window", "4", "--tau", "2.0", "--max-new-tokens", "12", "--json")
    assert code == 0, err
    doc = json.loads(out)
    row = doc["results"][0]
    ids = tk.encode("count with me: one, two")
    assert row["prompt_ids"] == ids
    stops = doc["total"]["stop_token_ids"]
    # defaults: generation_config eos ids, the config's eos, tokenizer eos_token and <|im_end|>
    assert set(stops) == {tk.token_id("<|endoftext|>"), 5, tk.token_id("<|im_end|>")}
    want = generate(params, config, [ids], DecodeConfig(window=4, tau=2.0, max_new_tokens=12,
                                                        stop_token_ids=tuple(stops)))
    assert row["ids"] == want.tokens[0]
    assert row["text"] == tk.decode(want.tokens[0])
    st = row["stats"]
    assert st["n_gen"] == len(row["ids"]) and st["p_cache"] == pytest.approx(st["n_gen"] / st["token_slots"])
    # --stream prints the text as it is committed and changes nothing in the result
    code, out2, err2 = _cli(capsys, "--checkpoint", path, "--prompt", "count with me: one, two",
                            "--window", "4", "--tau", "2.0", "--max-new-tokens", "12", "--json", "--stream")
    assert code == 0, err2
    assert json.loads(out2)["results"][0]["ids"] == row["ids"]
    assert err2.strip() == row["text"].strip()


def test_chat_prompts_file_and_ar(ckpt, capsys, tmp_path):
    path, config, params = ckpt
    tk = load_tokenizer(path)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps("hello world") + "\n" + json.dumps({"prompt": "the cat"}) + "\n\n" +
                 json.dumps({"messages": [{"role": "user", "content": "one two"}]}) + "\n")
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompts-file", str(f), "--chat",
                          "--method", "ar", "--max-new-tokens", "6", "--json", "--no-default-stops")
    assert code == 0, err
    rows = json.loads(out)["results"]
    assert len(rows) == 3
    rendered = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert rows[0]["prompt"] == rendered and rows[0]["prompt_ids"] == tk.encode(rendered)
    assert tk.token_id("<|im_start|>") in rows[0]["prompt_ids"]
    assert rows[2]["prompt"] == "<|im_start|>user\none two<|im_end|>\n<|im_start|>assistant\n"
    want = generate(params, config, [r["prompt_ids"] for r in rows],
                    DecodeConfig(method="ar", max_new_tokens=6))
    assert [r["ids"] for r in rows] == want.tokens
    assert all(len(r["ids"]) == 6 for r in rows)


def test_stop_strings(ckpt):
    path, _, _ = ckpt
    tk = load_tokenizer(path)
    single = tk.decode([tk.encode("hello")[0]])
    ids, cut = split_stop_strings(tk, [single, "cat sat on"])
    assert ids == [tk.encode("hello")[0]] and cut == ["cat sat on"]
    with pytest.raises(DecodeConfigError, match="stop string '' tokenizes to nothing"):
        split_stop_strings(tk, [""])
    seq = tk.encode("the cat sat on the mat")
    kept, text, hit = stop_at_strings(tk, seq, ["sat on"])
    assert hit and tk.decode(kept).endswith("sat on") and len(kept) < len(seq)
    assert text == tk.decode(kept)[:-len("sat on")] and not text.endswith("sat on")
    assert stop_at_strings(tk, seq, ["dog"]) == (seq, tk.decode(seq), False)


def test_cli_bad_input(ckpt, capsys, tmp_path):
    path, _, _ = ckpt
    for argv, words in [(["--window", "0"], "window must be an int in [1, 256], got 0"),
                        (["--method", "beam"], "method 'beam' is unknown; allowed: streaming, block, ar"),
                        (["--top-p", "0"], "top_p must be in (0, 1]"),
                        (["--stop", ""], "stop string '' tokenizes to nothing")]:
        code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "hi", *argv)
        assert code == 2 and words in err, (argv, err)
    code, _, err = _cli(capsys, "--checkpoint", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "no tokenizer.json" in err
    code, _, err = _cli(capsys, "--checkpoint", path, "--prompt", "")
    assert code == 2 and "prompt 0 is empty" in err


# ------------------------------------------------------------------ bounds

def test_decode_bounds_refused_or_limited_before_compiling(ckpt, capsys, tmp_path):
    """A window past the budget runs at the budget's width; one past MAX_WINDOW, a budget past
    the model's positions, or past memory, is refused before anything compiles; a trace into a
    missing folder is refused before decoding."""
    from decode.config import MAX_WINDOW
    from decode.engine.step.programs import compiled_count
    from decode.static.static_batch import static_decoder
    path, config, params = ckpt
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two", "--window", "100000")
    assert code == 2 and f"window must be an int in [1, {MAX_WINDOW}], got 100000" in err, err
    with pytest.raises(DecodeConfigError, match="window must be an int in"):
        DecodeConfig(window=MAX_WINDOW + 1)
    dc = DecodeConfig(window=MAX_WINDOW, max_new_tokens=6, tau=2.0)
    assert static_decoder(params, config, 1, dc, 10, 6).window == 6
    res = generate(params, config, [[3, 4, 5, 6]], dc)
    assert len(res.tokens[0]) == 6
    before = compiled_count()
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two",
                          "--max-new-tokens", "1000000000")
    assert code == 2 and "max_position_embeddings" in err and "--allow-long" in err, err
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two", "--allow-long",
                          "--max-new-tokens", "1000000000")
    assert code == 2 and "decoding needs ~" in err and "GiB" in err, err
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two",
                          "--trace", str(tmp_path / "missing" / "t.html"))
    assert code == 2 and "does not exist" in err, err
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two", "--refill", "x")
    assert code == 2 and "refill 'x' is unknown; allowed: before, after" in err, err
    assert compiled_count() == before


def test_interrupt_stops_within_a_chunk_and_keeps_the_text(ckpt, monkeypatch, capsys):
    """Ctrl-C (a KeyboardInterrupt between chunks) ends the decode with what it has: the CLI
    prints the text and the summary and exits 130."""
    from decode.static import static_batch as engine
    path, config, params = ckpt
    calls = []

    def interrupt(row, ids):
        calls.append(ids)
        raise KeyboardInterrupt

    res = generate(params, config, [[3, 4, 5]], DecodeConfig(method="ar", max_new_tokens=200),
                   capacity=256, on_commit=interrupt)
    assert res.interrupted and 0 < len(res.tokens[0]) < 200
    assert res.tokens[0] == calls[0]
    monkeypatch.setattr(engine, "STATIC_STEPS_PER_CALL", 4)
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two", "--method", "ar",
                          "--max-new-tokens", "100", "--stream", "--no-default-stops")
    assert code == 0
    real_generate = engine.generate

    def ctrl_c_after_first_chunk(*a, **kw):
        inner = kw["on_commit"]

        def cb(row, ids):
            inner(row, ids)
            raise KeyboardInterrupt
        return real_generate(*a, **dict(kw, on_commit=cb))
    monkeypatch.setattr(engine, "generate", ctrl_c_after_first_chunk)
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two", "--method", "ar",
                          "--max-new-tokens", "100", "--stream", "--no-default-stops")
    assert code == 130 and "interrupted" in err and "tokens" in err, err
    assert out.strip()          # the text decoded before the interrupt is printed


def test_interrupt_inside_a_call_keeps_the_tokens_handed_out_before_it(ckpt, monkeypatch, capsys):
    """Ctrl-C while a generate call holds the donated state (its buffers are gone): the rows keep
    the tokens of the chunks before it, and wedlm-decode prints them and exits 130."""
    from decode.engine.runtime.decoder import Decoder
    path, config, params = ckpt
    real, calls = Decoder.generate, []

    def interrupted_second_call(self, state, *a, **kw):
        out = real(self, state, *a, **kw)        # the state passed in is donated: deleted now
        calls.append(out[1])
        if len(calls) == 3:                      # the compile call, one chunk, then Ctrl-C
            raise KeyboardInterrupt
        return out
    monkeypatch.setattr(Decoder, "generate", interrupted_second_call)
    res = generate(params, config, [[3, 4, 5]], DecodeConfig(method="ar", max_new_tokens=200),
                   capacity=256)
    first_chunk = calls[1].new_ids(0)
    assert res.interrupted and res.tokens[0] == first_chunk and 0 < len(first_chunk) < 200
    # the forwards of the chunks before it are counted (AR: one token a forward), and the row's
    # finish says it was cut
    assert res.steps == res.rows[0].steps == len(first_chunk) > 0
    assert res.rows[0].finish == "interrupted"
    calls.clear()
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two", "--method", "ar",
                          "--max-new-tokens", "100", "--no-default-stops")
    assert code == 130 and "interrupted" in err and "Array has been deleted" not in err, err
    assert out.strip() and " 0 forwards" not in err, err
    calls.clear()
    code, out, err = _cli(capsys, "--checkpoint", path, "--prompt", "one two", "--method", "ar",
                          "--max-new-tokens", "100", "--no-default-stops", "--json")
    got = json.loads(out)
    assert code == 130 and got["total"]["interrupted"] and got["total"]["steps"] > 0
    assert got["results"][0]["finish"] == "interrupted"


def test_persistent_compilation_cache_is_reused_by_the_next_run(ckpt, tmp_path):
    """The first run fills --compile-cache; a second run of the same command compiles nothing new
    (every program loads from the folder) and prints the same text; the prompts-file keys are
    checked with line numbers."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cache = tmp_path / "xla"
    argv = [sys.executable, "-m", "decode.cli", "--checkpoint", ckpt[0], "--prompt", "count with me",
            "--max-new-tokens", "8", "--compile-cache", str(cache)]
    from tests import xla        # full compiles: each program well past the cache's 0.5 s floor
    env = dict(xla.full_compile(os.environ), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert first.returncode == 0, first.stderr[-3000:]
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "the first run wrote nothing to the cache"
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert sorted(p.name for p in cache.iterdir()) == entries      # nothing compiled anew


def test_prompts_file_lines_are_named_and_unknown_keys_refused(ckpt, capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps("fine") + "\n\n" + json.dumps({"prompt": "x", "temprature": 0.7}) + "\n")
    code, _, err = _cli(capsys, "--checkpoint", ckpt[0], "--prompts-file", str(f))
    assert code == 2
    assert f"{f}:3: unknown key(s) 'temprature'; a --prompts-file line holds" in err
    f.write_text(json.dumps("fine") + "\n" + json.dumps(7) + "\n")
    code, _, err = _cli(capsys, "--checkpoint", ckpt[0], "--prompts-file", str(f))
    assert code == 2 and f"{f}:2: expected a string or an object" in err


@pytest.mark.parametrize("door", ["prompt", "input", "serve"])
def test_ctrl_c_while_loading_is_one_line_and_exit_130(ckpt, monkeypatch, capsys, tmp_path, door):
    """Ctrl-C before decoding begins (here: while the weights load) ends wedlm-decode (a prompt,
    a batch job) and wedlm-serve with one line and exit 130, no traceback."""
    from decode.checkpoint import OpenCheckpoint
    from decode.serving import serve

    def ctrl_c(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(OpenCheckpoint, "load", ctrl_c)
    path = ckpt[0]
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "one two"}\n')
    argv = {"prompt": ["--checkpoint", path, "--prompt", "one two"],
            "input": ["--checkpoint", path, "--input", str(src), "--output", str(tmp_path / "o")],
            "serve": ["--checkpoint", path, "--port", "0"]}[door]
    try:
        code = (serve.main if door == "serve" else cli.main)(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while loading escaped (a KeyboardInterrupt traceback)")
    err = capsys.readouterr().err.strip()
    assert code == 130 and len(err.splitlines()) == 1, err
    assert "interrupted (Ctrl-C) while loading or compiling" in err
    assert not (tmp_path / "o").exists()
