"""Nothing one request or one bad line can break: bounds at the door, a request the
engine fails on fails alone (the Batcher rebuilds its state and goes on), request size and nesting
limits, the context-length convention, and data lines read byte-exactly (a bad byte costs exactly
its line)."""

from __future__ import annotations

import json
import os

import pytest

from tests import plans
from decode.config import INT32_MAX, DecodeConfig, DecodeConfigError


# ---------------------------------------------------------------------------- bounds at the door

@pytest.mark.parametrize("field,value", [("top_k", 2**40), ("max_new_tokens", 2**31), ("seed", -1),
                                         ("seed", 2**32), ("window", 2**31), ("tau", float("inf"))])
def test_decode_config_bounds(field, value):
    with pytest.raises(DecodeConfigError, match=field):
        DecodeConfig(**{field: value})
    assert DecodeConfig(top_k=INT32_MAX, seed=2**32 - 1).top_k == INT32_MAX


def _decoder(ckpt, **kw):
    _, config, params = ckpt
    return plans.decoder(params, config, **dict(dict(method="streaming", window=4, slots=2, capacity=128,
                                                steps_per_call=4, sampling=True), **kw))


def test_request_bounds_are_refused_before_any_device_work(ckpt):
    from decode.engine.step.state import Request
    dec = _decoder(ckpt)
    for field, value in (("top_k", 2**40), ("seed", 2**33), ("max_new_tokens", 2**31),
                         ("temperature", float("inf"))):
        with pytest.raises(DecodeConfigError, match=field):
            dec.check_request(Request(prompt=(1, 2, 3), **{field: value}))


# ---------------------------------------------------------------------------- isolation

def test_a_request_that_fails_in_the_engine_fails_alone(ckpt):
    """The prefill of one request raises: that request finishes 'error' with the reason, the
    others give the tokens they give alone, and the Batcher serves new requests afterwards. A
    failing generate call ends the requests in flight with 'error' and the state is rebuilt."""
    from decode.engine.runtime.batcher import Batcher
    from decode.engine.step.state import Request
    dec = _decoder(ckpt)
    alone = {}
    for p in ((5, 6, 7), (9, 8)):
        b = Batcher(dec)
        b.submit(Request(prompt=p, max_new_tokens=12), on_finish=lambda f, p=p: alone.__setitem__(p, f.tokens))
        b.run_until_idle()
    poison = (3, 3, 3, 3)
    real_prefill = dec.prefill

    def prefill(request):
        if tuple(request.prompt) == poison:
            raise OverflowError("Python int too large to convert to C int")
        return real_prefill(request)
    dec.prefill = prefill
    b = Batcher(dec)
    done = {}
    for p in ((5, 6, 7), poison, (9, 8)):
        b.submit(Request(prompt=p, max_new_tokens=12), on_finish=lambda f, p=p: done.__setitem__(p, f))
    b.run_until_idle()
    assert done[poison].finish == "error" and "OverflowError" in done[poison].error
    assert done[(5, 6, 7)].tokens == alone[(5, 6, 7)] and done[(9, 8)].tokens == alone[(9, 8)]

    real_generate = dec.generate
    calls = {"n": 0}

    def generate(state, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: device out of memory")
        return real_generate(state, **kw)
    dec.generate = generate
    done.clear()
    b.submit(Request(prompt=(5, 6, 7), max_new_tokens=12), on_finish=lambda f: done.__setitem__("a", f))
    b.run_until_idle()
    assert done["a"].finish == "error" and "RESOURCE_EXHAUSTED" in done["a"].error and b.resets == 1
    b.submit(Request(prompt=(5, 6, 7), max_new_tokens=12), on_finish=lambda f: done.__setitem__("b", f))
    b.run_until_idle()
    assert done["b"].finish == "length" and done["b"].tokens == alone[(5, 6, 7)]


# ---------------------------------------------------------------------------- byte-exact lines

def test_a_bad_byte_costs_exactly_its_line(tmp_path, ckpt):
    """Bad lines at the start, in the middle, at a read-buffer boundary and at the end: with
    skip_bad_lines every good line is used and each bad one is named file:line; without it the
    error names the first bad line."""
    from train.data.pipeline import DataError, iter_documents, load_tokenizer
    folder, config, _ = ckpt
    tok, vocab = load_tokenizer(folder), config.vocab_size
    path = tmp_path / "data.jsonl"
    n, lines, bad, size, straddled = 4000, [], [], 0, False
    for i in range(1, n + 1):
        good = json.dumps({"text": f"good line {i}"}).encode() + b"\n"
        straddle = not straddled and size < 65536 < size + len(good) + 8
        if i in (1, 57, n) or straddle:     # the start, the middle, a 64 KiB boundary, the end
            line = b'{"text": "bad \xff\xfe byte"}\n'
            bad.append(i)
            straddled = straddled or straddle
        else:
            line = good
        lines.append(line)
        size += len(line)
    path.write_bytes(b"".join(lines))
    assert len(bad) == 4 and straddled
    skipped, counts = [], {}
    docs = list(iter_documents([str(path)], tok, vocab_size=vocab, skip_bad_lines=True,
                               skipped=skipped, counts=counts))
    assert len(docs) == n - len(bad) == counts["lines"] - len(skipped)   # lines: every non-blank one
    assert [s.split(":")[1] for s in skipped] == [str(i) for i in bad]
    assert all("not UTF-8" in s for s in skipped)
    with pytest.raises(DataError, match=f"{path}:1: not UTF-8"):
        list(iter_documents([str(path)], tok, vocab_size=vocab))


def test_batch_job_names_a_non_utf8_line(tmp_path, ckpt):
    from decode.jobs.lines import read_input
    from decode.config import Sampling
    from decode.text import load_tokenizer
    tok = load_tokenizer(ckpt[0])
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "bad \xff"}\n')
    with pytest.raises(DecodeConfigError, match=f"{path}:2: not UTF-8"):
        read_input(str(path), tok, Sampling(), [], [], False, 128)


def test_out_of_memory_compile_is_a_verdict(capsys, monkeypatch):
    from train import dry_run
    from train.config import load_config
    msg = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
           "hbm. Used 27.67G of 15.75G hbm.\nHLO temporaries (27.67G) exceeds available HBM (15.75G)")
    assert "27.67G" in dry_run.out_of_memory(RuntimeError(msg))
    assert dry_run.out_of_memory(ValueError("something else")) is None

    def boom(*a, **k):
        raise RuntimeError(msg)
    monkeypatch.setattr(dry_run, "report", boom)
    cfg = load_config("configs/tiny_cpu.yaml")
    assert dry_run.run(cfg, 16.0, devices=1, source="tiny") == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "27.67G" in out and "Traceback" not in out
    monkeypatch.setattr(dry_run, "report", lambda *a, **k: (_ for _ in ()).throw(KeyError("x")))
    with pytest.raises(KeyError):
        dry_run.run(cfg, 16.0, devices=1)


def test_dry_run_from_a_plain_shell_forces_its_devices():
    """`python -m train.main ... --dry-run` with no XLA_FLAGS set compiles on the
    4 devices its mesh needs (it used to fail: jax had started with 1 device before forcing)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "train.main", "--config", "configs/tiny_cpu.yaml",
                        "--dry-run", "--device-memory", "80", "mesh.data=1", "mesh.fsdp=4"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fsdp=4" in r.stdout and "on 4 cpu devices" in r.stdout and "FITS" in r.stdout, r.stdout


# ---------------------------------------------------------------------- one line per failure

def _tiny_run(tmp_path, steps=4, every=2):
    from tests.synthetic import train_data as fixtures
    paths = fixtures.make_tiny_setup(str(tmp_path / "data"), num_docs=16)
    return fixtures.write_config(str(tmp_path / "cfg.yaml"), fixtures.tiny_config_dict(
        paths, **{"steps": steps, "checkpoint.dir": str(tmp_path / "ck"),
                  "checkpoint.every": every, "checkpoint.async_save": False}))


def test_training_counts_and_names_skipped_lines_in_its_metrics(tmp_path):
    """With data.skip_bad_lines a bad line costs that line alone: the run's metrics count the
    skipped lines in every row and name them (file:line) in the first."""
    from train import main as main_lib
    from train.config import load_config
    cfg = _tiny_run(tmp_path, steps=3, every=3)
    data = tmp_path / "data" / "train.jsonl"
    lines = data.read_bytes().splitlines(keepends=True)
    lines[2:2] = [b'{"text": "caf\xe9"}\n']               # not UTF-8: line 3
    lines.append(b"{not json\n")                             # the last line
    data.write_bytes(b"".join(lines))
    res = main_lib.run(load_config(cfg, ["data.skip_bad_lines=true"]), progress=False)
    assert [s.split(":")[1] for s in res["skipped_lines"]] == ["3", str(len(lines))]
    rows = [json.loads(x) for x in open(tmp_path / "ck" / "metrics.jsonl")]
    assert [r["skipped_lines"] for r in rows] == [2] * len(rows) and rows[0]["step"] == 1
    assert [w.split(":")[0:2] for w in rows[0]["skipped_where"]] == [[str(data), "3"],
                                                                       [str(data), str(len(lines))]]
    assert "skipped_where" not in rows[-1]


def _wedlm_lines(err: str) -> list:
    """The programs' own message lines (not the progress bar's)."""
    return [ln for ln in err.splitlines() if ln.startswith("wedlm-") and ": error:" in ln]


def test_too_little_room_for_a_checkpoint_stops_in_one_line(tmp_path, capsys, monkeypatch):
    """The free space is checked before each checkpoint: too little stops the run with one line
    naming the sizes, and the checkpoint already written stays complete and resumable."""
    from train import main as main_lib
    from train.checkpoint import complete_steps
    from wedlm_jax.runtime import failures
    cfg = _tiny_run(tmp_path)
    real, calls = failures.free_bytes, []

    def free(path):
        calls.append(path)
        return 1000 if len(calls) >= 2 else real(path)             # full at the second checkpoint
    monkeypatch.setattr(failures, "free_bytes", free)
    code = main_lib.main(["--config", cfg])
    err = capsys.readouterr().err
    assert code == 1, err
    (line,) = _wedlm_lines(err)
    assert line.startswith("wedlm-train: error: disk full: the checkpoint of step 4 needs about ")
    assert " free on /" in line and "; kept the complete checkpoint of step 2 in" in line
    assert "Traceback" not in err and complete_steps(str(tmp_path / "ck")) == [2]
    monkeypatch.setattr(failures, "free_bytes", real)
    assert main_lib.main(["--config", cfg]) == 0                       # the rerun resumes
    assert complete_steps(str(tmp_path / "ck"))[0] == 4


def test_disk_full_inside_the_checkpoint_writer_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    from train import checkpoint as ckpt
    from train import main as main_lib
    cfg = _tiny_run(tmp_path)
    real = ckpt.save

    def save(mgr, step, *a, **k):
        if step == 4:
            try:
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ck" / "4"))
            except OSError as inner:      # wrapped, as Orbax re-raises its writer's error
                raise RuntimeError("async save failed") from inner
        return real(mgr, step, *a, **k)
    monkeypatch.setattr(ckpt, "save", save)
    code = main_lib.main(["--config", cfg])
    err = capsys.readouterr().err
    assert code == 1, err
    (line,) = _wedlm_lines(err)
    assert "disk full: [Errno 28] No space left on device" in line
    assert "kept the complete checkpoint of step 2" in line and "Traceback" not in err


def test_disk_full_while_the_batch_job_writes_is_one_line(tmp_path, ckpt, capsys, monkeypatch):
    import errno

    from decode import cli
    from decode.jobs import batch_job
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"line {i}", "max_tokens": 4}) + "\n"
                           for i in range(4)))
    out = tmp_path / "out.jsonl"
    real, written = batch_job._append, []

    def append(f, record):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(out))
        written.append(record)
        real(f, record)
    monkeypatch.setattr(batch_job, "_append", append)
    argv = ["--checkpoint", ckpt[0], "--input", str(src), "--output", str(out), "--slots", "1",
            "--capacity", "64"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    (line,) = _wedlm_lines(err)
    assert line.startswith("wedlm-decode: error: disk full: [Errno 28] No space left on device")
    assert "already in" in line and "Traceback" not in err
    assert len(out.read_text().splitlines()) == 2
    monkeypatch.setattr(batch_job, "_append", real)
    assert cli.main(argv) == 0                                      # the rerun completes the rest
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [0, 1, 2, 3]


def test_out_of_device_memory_is_one_line(tmp_path, capsys, monkeypatch, ckpt):
    """XLA's RESOURCE_EXHAUSTED (at compile or run time) ends wedlm-train and wedlm-decode with one
    line naming what to lower, exit 1, no traceback."""
    import jax

    from decode import cli
    from train import main as main_lib
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                                     "19.27GiB.\nBufferAssignment OOM Debugging.")

    def boom(*a, **k):
        raise oom
    monkeypatch.setattr(main_lib, "run", boom)
    assert main_lib.main(["--config", _tiny_run(tmp_path)]) == 1
    err = capsys.readouterr().err
    (line,) = _wedlm_lines(err)
    assert line.startswith("wedlm-train: error: out of device memory: RESOURCE_EXHAUSTED: Out of "
                           "memory while trying to allocate 19.27GiB.; lower data.global_batch_size")
    monkeypatch.setattr(cli, "run", boom)
    assert cli.main(["--checkpoint", ckpt[0], "--prompt", "hi"]) == 1
    (line,) = _wedlm_lines(capsys.readouterr().err)
    assert line.startswith("wedlm-decode: error: out of device memory: RESOURCE_EXHAUSTED") \
        and "lower --capacity" in line


def test_decoding_takes_the_tokenizers_mask_token_when_the_config_has_none(tmp_path, capsys):
    """A config with `mask_token_id: null` (not a released `wedlm` one) decodes with the
    tokenizer's <|mask|>, as training finds it: the same text as the config that states it."""
    import shutil

    from decode import cli
    from demo.eval import DEMO_MODEL
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL, folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["mask_token_id"] == 2
    cfg["mask_token_id"] = None
    (folder / "config.json").write_text(json.dumps(cfg))
    argv = ["--prompt", "Count by 3 from 1521 to 1551:\n1521, 1524, ", "--max-new-tokens", "16",
            "--window", "8", "--json"]
    assert cli.main(["--checkpoint", DEMO_MODEL, *argv]) == 0
    want = json.loads(capsys.readouterr().out)["results"][0]["ids"]
    assert cli.main(["--checkpoint", str(folder), *argv]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["ids"] == want
    # the library door, through the same opener: the loaded config carries the decided id
    from decode.checkpoint import OpenCheckpoint
    from decode.static.static_batch import generate
    ckpt = OpenCheckpoint.open(str(folder))
    config, params, _ = ckpt.load()
    assert config.mask_token_id == 2
    ids = ckpt.tokenizer.encode(argv[1])
    got = generate(params, config, [ids], DecodeConfig(window=8, max_new_tokens=16,
                                                       stop_token_ids=ckpt.default_stop_ids))
    assert got.tokens[0] == want
