"""wedlm-decode --input/--output: every line checked before anything loads, results
written as requests finish, a SIGKILLed run resumed: every request exactly once, greedy results equal
to `decode.static.static_batch.generate()` on the prompt alone."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

from decode import cli
from decode.config import DecodeConfig
from decode.static.static_batch import generate
from decode.text import load_tokenizer
from tests.batch_lines import CAPACITY, WINDOW, request_lines, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BAD_LINES = [
    ('{"prompt": "hi", "tau": -1}', "tau"),
    ('{"prompt": "hi", "temprature": 0.5}', "temprature"),
    ('{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": 5}', "prompt"),
    ('{"messages": [{"role": "user"}]}', "messages"),
    ('{"prompt": "hi", "stop": ' + json.dumps(list("abcdefghijklmnopq")) + "}", "stop"),
    ('{"prompt": "' + "one two three " * 20 + '"}', "prompt"),     # longer than --capacity 32
    ('{"id": 1, "prompt": "hi"}', "id"),                           # line 1 has id 1 too
]


def test_bad_lines_named_before_anything_loads(ckpt, tmp_path, capsys):
    path = ckpt[0]
    out = tmp_path / "out.jsonl"
    for bad, field in BAD_LINES:
        src = write_jsonl(tmp_path / "in.jsonl", ['{"id": 1, "prompt": "one two"}', "", bad])
        code = cli.main(["--checkpoint", path, "--input", src, "--output", str(out), "--capacity", "32"])
        err = capsys.readouterr().err
        assert code == 2 and f"in.jsonl:3: field '{field}'" in err, (bad, err)
        assert not out.exists()
    src = write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "one"}', "{not json"])
    assert cli.main(["--checkpoint", path, "--input", src, "--output", str(out)]) == 2
    assert "in.jsonl:2: not valid JSON" in capsys.readouterr().err
    src = write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "one"}'])
    assert cli.main(["--checkpoint", path, "--input", src, "--output", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    bad_out = write_jsonl(tmp_path / "foreign.jsonl", ['{"not": "a result"}'])
    assert cli.main(["--checkpoint", path, "--input", src, "--output", bad_out]) == 2
    assert "refusing to append" in capsys.readouterr().err
    assert open(bad_out).read() == '{"not": "a result"}\n'          # left as it was


def test_every_bad_line_reported_in_one_run(ckpt, tmp_path, capsys):
    """Bad lines 2-5 and 7 (a field, JSON, a setting, an id, a setting by its OpenAI name): all
    five named in one refusal, each as the line spelled it, exit 2,
    nothing written; past MAX_REPORTED bad lines the rest are counted."""
    from decode.jobs.lines import MAX_REPORTED
    path = ckpt[0]
    out = tmp_path / "out.jsonl"
    src = write_jsonl(tmp_path / "in.jsonl", ['{"id": 1, "prompt": "one two"}',
                                              '{"prompt": "hi", "temprature": 0.5}', "{not json",
                                              '{"prompt": "hi", "tau": -1}', '{"id": 1, "prompt": "hi"}',
                                              '{"prompt": "three"}', '{"prompt": "x", "max_tokens": 0}'])
    code = cli.main(["--checkpoint", path, "--input", src, "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists(), err
    assert "5 bad input lines" in err, err
    for where in ("in.jsonl:2: field 'temprature'", "in.jsonl:3: not valid JSON",
                  "in.jsonl:4: field 'tau'", "in.jsonl:5: field 'id'",
                  "in.jsonl:7: field 'max_tokens': max_tokens must be"):   # the line's own name
        assert where in err, (where, err)
    assert "in.jsonl:1:" not in err and "in.jsonl:6:" not in err and "max_new_tokens must" not in err
    n = MAX_REPORTED + 5
    src = write_jsonl(tmp_path / "many.jsonl", ['{"prompt": 5}'] * n)
    assert cli.main(["--checkpoint", path, "--input", src, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{n} bad input lines" in err and f"many.jsonl:{MAX_REPORTED}: field 'prompt'" in err
    assert f"many.jsonl:{MAX_REPORTED + 1}:" not in err and "... and 5 more bad lines" in err


def test_sigkill_mid_file_then_resume_each_request_exactly_once(ckpt, tmp_path, capsys):
    path, config, params = ckpt
    lines = request_lines()
    src = write_jsonl(tmp_path / "prompts.jsonl", lines)
    out = tmp_path / "results.jsonl"
    argv = ["--checkpoint", path, "--input", src, "--output", str(out), "--slots", "2",
            "--window", str(WINDOW), "--capacity", str(CAPACITY), "--steps-per-call", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "decode.cli"] + argv, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    before = out.read_bytes()
    n_before = before.count(b"\n")
    assert 3 <= n_before < len(lines)
    with open(out, "ab") as f:                    # a crash in the middle of writing a line
        f.write(b'{"id": "r23", "text": "tor')
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "dropped a torn last line" in err and f"{n_before} of {len(lines)} requests already" in err
    assert "tokens/forward" in err and "p_cache" in err
    data = out.read_bytes()
    assert data.startswith(before)                # what was written stays as it was
    rows = [json.loads(x) for x in data.decode().splitlines()]
    assert collections.Counter(r["id"] for r in rows) == collections.Counter(line["id"] for line in lines)
    for r in rows:
        assert r["completion_tokens"] == len(r["token_ids"])
        if r["finish_reason"] == "length":     # ran to its end (stats of cancelled slots may be 0)
            assert r["token_slots"] >= r["steps"] >= 1
    # the same file decoded in one go (no kill; the same compiled programs): the same results, sampled
    # ones included (a request's draws depend on its seed only, not on what ran beside it)
    clean = tmp_path / "clean.jsonl"
    assert cli.main(argv[:5] + [str(clean)] + argv[6:]) == 0
    capsys.readouterr()
    keys = ("text", "token_ids", "finish_reason", "completion_tokens")
    resumed = {r["id"]: [r[k] for k in keys] for r in rows}
    assert {r["id"]: [r[k] for k in keys] for r in map(json.loads, clean.read_text().splitlines())} == resumed
    # greedy rows equal the prompt decoded alone with generate() (the same stops, capacity, settings)
    tok = load_tokenizer(path)
    stops = tuple(tok.default_stop_ids(config.eos_token_id))
    by_id = {r["id"]: r for r in rows}
    greedy = [line for line in lines if "temperature" not in line]
    for line in greedy[:8]:
        text = tok.apply_chat_template(line["messages"]) if "messages" in line else line["prompt"]
        dc = DecodeConfig(window=WINDOW, tau=line["tau"], max_new_tokens=line["max_tokens"], stop_token_ids=stops)
        want = generate(params, config, [tok.encode(text)], dc, capacity=CAPACITY).tokens[0]
        full, r = tok.decode(want), by_id[line["id"]]
        hits = [full.find(x) for x in line.get("stop", []) if x in full]
        cut = min(hits) if hits else -1
        if cut >= 0:
            assert r["text"] == full[:cut] and r["finish_reason"] == "stop", line
            assert r["token_ids"] == want[:len(r["token_ids"])]
        else:
            assert r["token_ids"] == want and r["text"] == full, line
    assert any(line.get("stop") and by_id[line["id"]]["finish_reason"] == "stop" for line in greedy[:8])
    # a third run finds nothing to do and leaves the file alone
    assert cli.main(argv) == 0 and out.read_bytes() == data


def test_a_request_the_engine_fails_on_is_an_error_result_and_the_job_goes_on(ckpt, tmp_path, capsys,
                                                                            monkeypatch):
    """One request's prefill raises inside the engine: its line is written with
    finish_reason 'error' and the reason, every other request is decoded as alone, the job exits 1
    with one line naming how many failed; a rerun does not decode it again."""
    from decode.engine.runtime.decoder import Decoder
    path, config, params = ckpt
    tok = load_tokenizer(path)
    lines = [{"id": f"q{i}", "prompt": p, "max_tokens": 6} for i, p in
             enumerate(["one two", "three four five", "six", "seven eight"])]
    poison = tuple(tok.encode("three four five"))
    real, real_paged = Decoder.prefill, Decoder.prefill_into_slot

    def check(request):
        if tuple(request.prompt) == poison:
            raise OverflowError("Python int too large to convert to C int")

    def prefill(self, request):          # the dense cache's admission
        check(request)
        return real(self, request)

    def prefill_into_slot(self, state, request, *args):     # the paged cache's (CPU's default)
        check(request)
        return real_paged(self, state, request, *args)
    monkeypatch.setattr(Decoder, "prefill", prefill)
    monkeypatch.setattr(Decoder, "prefill_into_slot", prefill_into_slot)
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    argv = ["--checkpoint", path, "--input", src, "--output", str(out), "--capacity", "64",
            "--window", str(WINDOW)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "1 request(s) failed in the engine" in err
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"q0", "q1", "q2", "q3"}
    assert rows["q1"]["finish_reason"] == "error" and "OverflowError" in rows["q1"]["error"]
    for key in ("q0", "q2", "q3"):
        assert rows[key]["finish_reason"] in ("stop", "length") and rows[key]["completion_tokens"] >= 1
    assert cli.main(argv) == 0 and "nothing to do" in capsys.readouterr().err


def test_input_honours_refill_prefill_chunk_and_sampling_order(ckpt, tmp_path, capsys, monkeypatch):
    """--refill, --prefill-chunk and --allow-long reach the batch job's Decoder, and
    --sampling-order (or a line's own `sampling_order`) its requests; greedy results equal
    generate() with the same settings."""
    from decode.engine.runtime import decoder as decoder_lib
    path, config, params = ckpt
    made, seen = [], []
    real_init = decoder_lib.Decoder.__init__

    def spy_init(self, params, plan):
        made.append(plan)
        real_init(self, params, plan)
    real_check = decoder_lib.Decoder.check_request

    def spy_check(self, req):
        seen.append((len(req.prompt), req.sampling_order))
        return real_check(self, req)
    monkeypatch.setattr(decoder_lib.Decoder, "__init__", spy_init)
    monkeypatch.setattr(decoder_lib.Decoder, "check_request", spy_check)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "one two three", "max_tokens": 12},
                                         {"id": "b", "prompt": "the cat", "max_tokens": 12,
                                          "sampling_order": "filter_first"}])
    out = tmp_path / "out.jsonl"
    assert cli.main(["--checkpoint", path, "--input", src, "--output", str(out), "--window", str(WINDOW),
                     "--capacity", str(CAPACITY), "--refill", "after", "--prefill-chunk", "16",
                     "--sampling-order", "temper_first", "--no-default-stops"]) == 0, capsys.readouterr().err
    assert made[-1].refill == "after" and made[-1].static.prefill_chunk == 16
    assert made[-1].capacity == CAPACITY
    tok = load_tokenizer(path)
    assert dict(seen) == {len(tok.encode("one two three")): "temper_first",
                          len(tok.encode("the cat")): "filter_first"}
    got = {r["id"]: r["token_ids"] for r in map(json.loads, open(out))}
    for rid, text in (("a", "one two three"), ("b", "the cat")):
        dc = DecodeConfig(method="streaming", window=WINDOW, refill="after", max_new_tokens=12)
        assert got[rid] == generate(params, config, [tok.encode(text)], dc, capacity=CAPACITY).tokens[0]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hi", "sampling_order": "random"}])
    assert cli.main(["--checkpoint", path, "--input", bad, "--output", str(tmp_path / "o2.jsonl")]) == 2
    assert "bad.jsonl:1: field 'sampling_order'" in capsys.readouterr().err


def test_a_job_of_short_answers_narrows_the_window_as_a_single_prompt_does(ckpt, tmp_path, capsys):
    """Every line asks for 5 tokens, the default window is 16 and the capacity is sized to the
    lines: the job decodes with the window cut to the budget, and each result equals the
    single-prompt path's (which cuts it the same way)."""
    path, config, params = ckpt
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": p, "max_tokens": 5}
                                              for i, p in enumerate(["a", "one", "the cat"])])
    out = tmp_path / "out.jsonl"
    code = cli.main(["--checkpoint", path, "--input", src, "--output", str(out), "--no-default-stops"])
    assert code == 0, capsys.readouterr().err
    got = {r["id"]: r for r in map(json.loads, open(out))}
    tok = load_tokenizer(path)
    for i, text in enumerate(["a", "one", "the cat"]):
        ids = tok.encode(text)
        want = generate(params, config, [ids], DecodeConfig(max_new_tokens=5), capacity=len(ids) + 5)
        assert got[i]["token_ids"] == want.tokens[0] and got[i]["finish_reason"] == "length"


def test_ctrl_c_keeps_the_finished_results_and_says_how_many(ckpt, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the batch job: the lines written so far are whole and counted, exit 130, and a
    rerun decodes only the rest."""
    from decode.engine.runtime.batcher import Batcher
    path = ckpt[0]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": "one two", "max_tokens": 2 + 10 * i}
                                         for i in range(4)])
    out = tmp_path / "out.jsonl"
    real = Batcher.step

    def step_then_ctrl_c(self):
        more = real(self)
        if os.path.exists(out) and open(out).read().count("\n") >= 1:
            raise KeyboardInterrupt
        return more
    monkeypatch.setattr(Batcher, "step", step_then_ctrl_c)
    code = cli.main(["--checkpoint", path, "--input", src, "--output", str(out), "--slots", "1",
                     "--window", str(WINDOW), "--no-default-stops"])
    err = capsys.readouterr().err.strip().splitlines()
    kept = open(out).read().count("\n")
    assert code == 130 and 1 <= kept < 4, err
    assert err[-1] == (f"wedlm-decode: interrupted (Ctrl-C): {kept} result(s) kept in {out}; rerun "
                       "the same command to decode the rest"), err
    monkeypatch.setattr(Batcher, "step", real)
    assert cli.main(["--checkpoint", path, "--input", src, "--output", str(out), "--slots", "1",
                     "--window", str(WINDOW), "--no-default-stops"]) == 0
    assert sorted(json.loads(x)["id"] for x in open(out)) == [0, 1, 2, 3]


def test_model_name_names_the_base_model_a_line_may_give(ckpt, tmp_path, capsys):
    """--model-name: a line's `model` may name the base model by it (as a client names
    wedlm-serve's); without it the folder's name is the base's, and another name is refused by
    line, naming the base."""
    path = ckpt[0]
    src = write_jsonl(tmp_path / "in.jsonl", ['{"id": "a", "prompt": "one two", "model": "mine", '
                                              '"max_tokens": 3}'])
    out = tmp_path / "out.jsonl"
    assert cli.main(["--checkpoint", path, "--input", src, "--output", str(out),
                     "--model-name", "mine"]) == 0
    assert [json.loads(l)["id"] for l in out.read_text().splitlines()] == ["a"]
    capsys.readouterr()
    folder = os.path.basename(os.path.normpath(path))
    assert cli.main(["--checkpoint", path, "--input", src, "--output", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "in.jsonl:1: field 'model': 'mine' is not an adapter" in err and repr(folder) in err, err
    assert cli.main(["--checkpoint", path, "--prompt", "hi", "--model-name", "mine"]) == 2
    assert "--model-name goes with --input" in capsys.readouterr().err    # never taken and ignored
