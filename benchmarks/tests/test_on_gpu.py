"""benchmarks.on_gpu at tiny shapes on this CPU (--smoke): the same code paths a lent GPU runs,
so a device's minutes are not spent finding a bug in the script."""

from __future__ import annotations

import json

from benchmarks import on_gpu


def test_smoke_run_measures_every_backend_and_step(tmp_path):
    out = tmp_path / "run"
    assert on_gpu.main(["--smoke", "--out", str(out), "--parts", "kernel,kernel_time,steps",
                        "--rounds", "1",
                        "--settings", "ar b8,streaming W16 after b8,ar b8 paged"]) == 0
    report = json.loads((out / "on_gpu.json").read_text())
    kernel = report["kernel"]
    assert {r["backend"] for r in kernel} == {"tiled", "cudnn", "pallas", "paged gather"}
    for r in kernel:
        assert "failed" not in r and not r["nan"], r
        assert r["rel_err"] < (1e-5 if r["dtype"] == "float32" else 1e-2), r
    timed = report["kernel_time"]
    assert len(timed) == 2 * (2 * len(on_gpu.KERNEL_SPLITS) + 1)          # 2 smoke points
    assert all(r["ms_per_layer"] > 0 and "failed" not in r for r in timed), timed
    steps = {r["setting"]: r for r in report["steps"]}
    assert set(steps) == {"ar b8", "streaming W16 after b8", "ar b8 paged"}
    assert steps["ar b8 paged"]["page_size"] == 64 and steps["ar b8"]["page_size"] == 0
    for r in steps.values():
        assert r["ms_per_step"] > 0 and len(r["ms_rounds"]) == 1, r
    assert steps["streaming W16 after b8"]["step_over_ar"] > 0


def test_bad_choices_exit_2_before_any_work(tmp_path, capsys):
    assert on_gpu.main(["--out", str(tmp_path / "a")]) == 2            # no GPU here
    assert "needs a GPU" in capsys.readouterr().err
    assert on_gpu.main(["--smoke", "--out", str(tmp_path / "b"), "--parts", "kernel,nope"]) == 2
    assert "unknown part" in capsys.readouterr().err
    assert on_gpu.main(["--smoke", "--out", str(tmp_path / "c"), "--settings", "ar b9"]) == 2
    assert "unknown setting" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_traces_come_back_as_files_of_the_out_folder(tmp_path):
    out = tmp_path / "run"
    assert on_gpu.main(["--smoke", "--out", str(out), "--parts", "steps", "--rounds", "1",
                        "--settings", "ar b8,ar b1", "--trace"]) == 0
    report = json.loads((out / "on_gpu.json").read_text())
    assert [r["trace"] for r in report["steps"]] == ["trace_0.json.gz", "trace_1.json.gz"]
    import gzip
    events = json.load(gzip.open(out / "trace_0.json.gz"))["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
