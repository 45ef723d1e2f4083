"""wedlm-decode --input on two processes: jax.distributed on localhost, each
process decodes its share of the lines (positions k, k + 2, ...) on its own CPU device into its own
part file; `python -m decode.jobs.batch_job merge` joins the parts; the merged results equal a one-process
run of the same file, id for id (sampled lines too: a request's draws depend on its seed only).
Bad merges are refused naming what is wrong. The test kills only the processes it started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from decode import cli
from decode.jobs import batch_job
from tests.batch_lines import CAPACITY, WINDOW, request_lines, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(path) -> dict:
    keys = ("text", "token_ids", "finish_reason", "completion_tokens")
    return {r["id"]: [r[k] for k in keys] for r in map(json.loads, open(path).read().splitlines())}


def test_two_processes_split_the_file_and_merge_to_the_one_process_result(ckpt, tmp_path, capsys):
    path = ckpt[0]
    lines = request_lines(10)
    src = write_jsonl(tmp_path / "prompts.jsonl", lines)
    out = str(tmp_path / "results.jsonl")
    common = ["--checkpoint", path, "--input", src, "--slots", "2", "--window", str(WINDOW),
              "--capacity", str(CAPACITY), "--steps-per-call", "2"]
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)           # one CPU device per process
    logs = [open(tmp_path / f"proc{k}.log", "w") for k in range(2)]   # files: no pipe to fill
    procs = [subprocess.Popen([sys.executable, "-m", "decode.cli", *common, "--output", out,
                               "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                               "--process-id", str(k)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=logs[k])
             for k in range(2)]
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in logs:
            f.close()
    errs = [open(tmp_path / f"proc{k}.log").read()[-3000:] for k in range(2)]
    assert [p.returncode for p in procs] == [0, 0], errs
    parts = [batch_job.part_path(out, k, 2) for k in range(2)]
    shares = [_rows(p) for p in parts]
    assert [sorted(s) for s in shares] == [sorted(line["id"] for line in lines[k::2]) for k in range(2)]
    assert not os.path.exists(out)
    # an incomplete merge is refused and writes nothing
    assert batch_job.main(["merge", out, "--input", write_jsonl(tmp_path / "more.jsonl",
                                                           lines + [{"id": "extra", "prompt": "hi"}])]) == 2
    assert "1 input id(s) have no result yet (first: \"extra\")" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert batch_job.main(["merge", out, "--input", src]) == 0
    merged = _rows(out)
    assert merged == {**shares[0], **shares[1]} and len(merged) == len(lines)
    # the same file in one process
    one = str(tmp_path / "one.jsonl")
    assert cli.main([*common, "--output", one]) == 0
    capsys.readouterr()
    assert _rows(one) == merged
    # a second merge does not overwrite; a missing part is named
    assert batch_job.main(["merge", out]) == 2
    assert "exists" in capsys.readouterr().err
    os.remove(parts[1])
    assert batch_job.main(["merge", str(tmp_path / "again.jsonl")]) == 2
    assert "no parts of one job" in capsys.readouterr().err
    os.rename(out, str(tmp_path / "again.jsonl.part-00000-of-00002"))
    assert batch_job.main(["merge", str(tmp_path / "again.jsonl")]) == 2
    assert "part 1 of 2 is missing" in capsys.readouterr().err


@pytest.mark.parametrize("flags,words", [
    (["--num-processes", "2", "--process-id", "0"], "multi-host needs the coordinator address"),
    (["--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id 2 must be in [0, --num-processes 2)"),
])
def test_bad_multihost_flags_are_one_line(ckpt, tmp_path, flags, words):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    r = subprocess.run([sys.executable, "-m", "decode.cli", "--checkpoint", ckpt[0], "--input", src,
                        "--output", str(tmp_path / "o.jsonl"), *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
