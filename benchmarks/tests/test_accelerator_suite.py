"""benchmarks.compiled.accelerator: the --smoke run (every section at tiny shapes on CPU) writes its JSON,
markdown and PNGs with consistent figures; the refusals (--smoke off CPU, no accelerator without
--smoke, a shape larger than the device memory, an occupied --out) come before any work."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.compiled import accelerator as acc
from benchmarks.shapes import SMOKE_SHAPE, TRAIN_SHAPE, model_config

GIB = acc.GIB


def test_smoke_run_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report"
    assert acc.main(["--smoke", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["accelerator.json", "accelerator.md", "decode_roofline.png",
                                       "train_mfu.png", "window_curve.png"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".accelerator-")]
    rep = json.loads((out / "accelerator.json").read_text())
    assert rep["device"]["platform"] == "cpu" and rep["plan"]["smoke"]
    assert rep["probes"]["bandwidth_bytes_per_s"] > 0 and rep["probes"]["matmul_flops"] > 0
    dec = rep["decode"]
    assert {(r["attention"], r["batch"]) for r in dec} == {(a, b) for a in ("dense", "tiled")
                                                            for b in (1, 8)}
    c = model_config(SMOKE_SHAPE)
    for r in dec:
        assert r["step_s"] > 0
        assert r["kv_bytes"] == r["batch"] * 17 * acc.kv_bytes_per_token(c)
        assert r["roofline_s"] == pytest.approx((r["weights_bytes"] + r["kv_bytes"])
                                                / rep["probes"]["bandwidth_bytes_per_s"])
        assert r["roofline_pct"] == pytest.approx(100 * r["roofline_s"] / r["step_s"])
    w = rep["window"]
    assert w["after"]["1"] == 1.0
    assert w["before"]["2"] == pytest.approx(w["forward_s"]["4"] / w["forward_s"]["1"])
    assert {r["attention"] for r in rep["prefill"]} == {"dense", "tiled"}
    runs = [r for r in rep["train"] if "step_s" in r]
    assert {r["attention"] for r in runs} == {"dense", "tiled"}
    assert all(0 < r["mfu_probe"] and r["model_flops"] > 0 for r in runs)
    assert {r["attention"] for r in rep["train"] if "skipped" in r} == {"cudnn", "splash",
                                                                        "pallas"}
    assert rep["convert"]["round_trip_equal"] and rep["convert"]["checkpoint_bytes"] > 0
    md = (out / "accelerator.md").read_text()
    assert "--smoke" in md and "## AR decode step" in md and "## Train step" in md
    assert "python -m benchmarks.compiled.accelerator --smoke" in md
    for png in ("decode_roofline.png", "train_mfu.png", "window_curve.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refusals_come_first(tmp_path, capsys):
    out = tmp_path / "r"
    assert acc.main(["--smoke", "--device-memory-gib", "0.001", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no decode shape fits the device memory (0.00 GiB" in err
    assert "estimates: smoke at batch 8: 0.25 GiB (weights 0.00 GiB, kv_cache" in err
    assert acc.main(["--out", str(out)]) == 2
    assert "no accelerator here (jax's backend is 'cpu'): run with --smoke" in capsys.readouterr().err
    assert not out.exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep")
    assert acc.main(["--smoke", "--sections", "convert", "--out", str(busy)]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert (busy / "mine.txt").read_text() == "keep"
    assert acc.main(["--smoke", "--sections", "decode,bogus"]) == 2
    assert "--sections takes decode, window, prefill, train, convert; got bogus" in \
        capsys.readouterr().err


def test_plans_follow_the_device_memory():
    with pytest.raises(acc.SuiteError, match="--smoke runs the suite at tiny shapes on CPU only; "
                                             "this process sees the 'gpu' backend"):
        acc.make_plan("gpu", 80 * GIB, smoke=True)
    assert acc.make_plan("gpu", 80 * GIB, smoke=False).model == "8b"
    assert acc.make_plan("tpu", 16 * GIB, smoke=False).model == "1.7b"
    assert acc.make_plan("gpu", 24 * GIB, smoke=False).model == "4b"
    with pytest.raises(acc.SuiteError, match=r"\(20\.00 GiB, 90% usable = 18\.00 GiB\).*"
                                             r"8b at batch 64: 28\.\d\d GiB \(weights 15\.26 GiB"):
        acc.make_plan("gpu", 20 * GIB, smoke=False, model="8b")
    with pytest.raises(acc.SuiteError, match="--model must be one of 8b, 4b, 1.7b, 0.6b"):
        acc.make_plan("gpu", 80 * GIB, smoke=False, model="70b")
    # the train sweep's per-entry estimates: dense attention at L = 4096 needs its [T, T] scores
    c = model_config(TRAIN_SHAPE)
    dense, tiled = (acc.train_estimate(c, 1, 4096, impl)["total"] for impl in ("dense", "tiled"))
    assert dense - tiled > 32 * 8192 ** 2 * 4 * 3        # 32 heads' f32 [T, T] x 3


def test_a_failing_kernel_is_recorded_and_the_run_exits_nonzero(tmp_path, capsys, monkeypatch):
    """A kernel that fails on the device (e.g. a lowering error) costs its own entries only: the
    report is still written, the failure is in it, and the exit status is 1."""
    import benchmarks.decoding.window_cost as wc

    def fake_measure(config, params, windows, *a, attention="tiled", **kw):
        if attention == "tiled":
            raise RuntimeError("lowering failed\nsecond line")
        return {w: 1e-3 * w for w in windows}
    monkeypatch.setattr(wc, "measure", fake_measure)
    monkeypatch.setattr(acc, "device_params", lambda config, seed=0: None)
    out = tmp_path / "r"
    assert acc.main(["--smoke", "--sections", "decode,window", "--out", str(out)]) == 1
    assert "decode tiled: RuntimeError: lowering failed" in capsys.readouterr().err
    rep = json.loads((out / "accelerator.json").read_text())
    assert [r["failed"] for r in rep["decode"] if r["attention"] == "tiled"] == \
        ["RuntimeError: lowering failed"] * 2
    assert rep["window"]["attention"] == "dense" and rep["window"]["after"]["2"] == 2.0
    assert "| tiled | 1 | failed: RuntimeError: lowering failed |" in \
        (out / "accelerator.md").read_text()
