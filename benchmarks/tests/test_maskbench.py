"""benchmarks.structured.maskbench on a fixed subset of MaskBench's dev split (benchmarks/tests/data/maskbench:
7 files of at most 12 KB from each of its 15 sources, `random.Random(0).sample` over the sorted
names), the demo tokenizer and the auto backend: no invalidation error, no timeout at 20 s, the
passing count at its measured floor, the report's keys; the timeout path on one schema; bad input
refused in one line with exit 2."""

from __future__ import annotations

import json
import os
import random
import tarfile

import pytest

from benchmarks.structured import maskbench

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "maskbench")
ROOT = os.path.dirname(os.path.dirname(HERE))
DEMO_TOKENIZER = os.path.join(ROOT, "demo", "model")
N_FILES = 105
# measured 2026-11-29: PASSING_MEASURED of 105 pass (the rest: compile errors naming keywords
# neither backend enforces); the floor leaves room for the auto backend's choice (device when
# its tables are built within 2 s and the builder is free, else host) moving with the load
PASSING_MEASURED = 90
PASSING_FLOOR = PASSING_MEASURED - 4


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("maskbench") / "r.json"
    assert maskbench.main([DATA, "--tokenizer", DEMO_TOKENIZER, "--backend", "auto",
                           "--timeout", "20", "--out", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())


def test_subset_statuses(report):
    totals = report["totals"]
    assert set(totals) == set(maskbench.STATUSES)
    assert sum(totals.values()) == N_FILES
    bad = [r for r in report["schemas"] if r["status"] == "invalidation error"]
    assert bad == [], bad
    assert totals["timeout"] == 0
    assert totals["passing"] >= PASSING_FLOOR, totals
    assert report["unexpected"] == [], report["unexpected"]
    # the host takes what the device tables are not ready for, and refusals name what is wrong
    backends = {r["backend"] for r in report["schemas"] if r["status"] == "passing"}
    assert "host" in backends and backends <= {"device", "host"}
    for r in report["schemas"]:
        if r["status"] == "compile error":
            assert r["backend"] is None and r["error"]


def test_report_keys(report):
    assert {"totals", "schemas", "compile_ms", "mask_us", "tokenizer", "vocab_size", "date",
            "command"} <= set(report)
    assert report["vocab_size"] == 512
    assert set(report["compile_ms"]) == {"p50", "p90", "p99"}
    assert 0 < report["compile_ms"]["p50"] <= report["compile_ms"]["p90"] \
        <= report["compile_ms"]["p99"]
    assert "host" in report["mask_us"]
    for backend in report["mask_us"]:
        m = report["mask_us"][backend]
        assert 0 < m["p50"] <= m["p99"] and m["tokens"] > 0
    names = [r["file"] for r in report["schemas"]]
    assert names == sorted(os.listdir(DATA))
    for r in report["schemas"]:
        assert {"file", "status", "backend", "compile_ms"} <= set(r)
        assert (r["status"] == "passing") == ("error" not in r)
    assert report["command"].startswith("python -m benchmarks.structured.maskbench ")


def test_timeout_kills_and_restarts_the_worker():
    ((_, doc),) = maskbench.load_inputs([os.path.join(DATA, min(os.listdir(DATA)))])
    worker = maskbench.Worker(DEMO_TOKENIZER, "auto", 2.0)
    try:
        row = worker.run(doc, 0.001)
        assert row["status"] == "timeout" and row["backend"] is None
        assert worker.proc is None                       # killed
        row = worker.run(doc, 20.0)                      # a fresh worker takes the next one
        assert row["status"] != "timeout" and worker.starts == 2
    finally:
        worker.stop()


def test_inputs_sample_and_archives(tmp_path):
    names = sorted(os.listdir(DATA))
    sample = maskbench.load_inputs([DATA], limit=10, seed=3)
    assert [n for n, _ in sample] == random.Random(3).sample(names, 10)
    with tarfile.open(tmp_path / "split.tar.gz", "w:gz") as tar:
        tar.add(DATA, arcname="split")
    from_tar = maskbench.load_inputs([str(tmp_path / "split.tar.gz")], limit=10, seed=3)
    assert from_tar == sample


@pytest.mark.parametrize("case", ["missing", "no_tests", "tokenizer", "not_json"])
def test_bad_input_is_one_line_exit_2(case, tmp_path, capsys):
    good = os.path.join(DATA, min(os.listdir(DATA)))
    inputs, tokenizer = [good], DEMO_TOKENIZER
    if case == "missing":
        inputs = [str(tmp_path / "nope")]
    elif case == "no_tests":
        (tmp_path / "x.json").write_text(json.dumps({"schema": {"type": "string"}}))
        inputs = [str(tmp_path)]
    elif case == "tokenizer":
        tokenizer = str(tmp_path)
    else:
        (tmp_path / "x.json").write_text("{not json")
        inputs = [str(tmp_path)]
    assert maskbench.main([*inputs, "--tokenizer", tokenizer, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m benchmarks.structured.maskbench: error: ")
    assert "Traceback" not in err
