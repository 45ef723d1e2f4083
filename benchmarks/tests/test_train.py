"""benchmarks.training.train at toy size: the train step's tokens/s and MFU, and the attention's share."""

from __future__ import annotations

import json

import pytest

from benchmarks.training import train


def test_tiny_step_throughput_and_shares(tmp_path):
    path = tmp_path / "train.json"
    out = train.main(["--models", "tiny", "--seq-len", "64", "--rows", "2", "--steps", "2",
                      "--matmul-n", "256", "--out", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    (r,) = out["results"]
    assert (r["model"], r["attention"], r["rows"], r["seq_len"]) == ("tiny", "tiled", 2, 64)
    assert len(r["step_times_s"]) == 2 and r["step_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_s"])
    assert 0 < r["mfu"] < 2 and 0 < r["attention_flop_share"] < 1
    assert r["attention_time_share"] > 0 and out["info"]["f32_matmul_gflops"] > 0
