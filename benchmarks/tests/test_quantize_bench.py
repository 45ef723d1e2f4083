"""benchmarks.quantize at toy size: milliseconds per AR step of the demo model, float32 against
int8 weights, and the weights' bytes as the Decoder holds them."""

from __future__ import annotations

from benchmarks import quantize


def test_step_time_float32_against_int8(tmp_path):
    out = quantize.main(["--slots", "2", "--chunks", "1", "--regimes", "float32:none,float32:int8",
                         "--out", str(tmp_path / "q.json")])
    f32, int8 = out["results"]
    assert (f32["quantize"], int8["quantize"]) == ("none", "int8")
    assert all(0 < r["ms_per_step"] < 10_000 for r in out["results"]), out
    assert int8["weight_bytes"] < 0.3 * f32["weight_bytes"]       # int8 kernels, float32 rest
    assert (tmp_path / "q.json").exists()
