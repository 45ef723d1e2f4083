"""benchmarks.quantized.quantize, benchmarks.quantized.kv_int8 and benchmarks.quantized.quantize_heldout at toy size:
milliseconds per AR step of the demo model, float32 against int8 weights (the weights' bytes as
the Decoder holds them) and against the int8 KV cache (the tokens kept, the KL, the cache's
bytes); the held-out accuracies per scheme and their differences."""

from __future__ import annotations

from benchmarks.quantized import quantize


def test_step_time_float32_against_int8(tmp_path):
    out = quantize.main(["--slots", "2", "--chunks", "1", "--regimes", "float32:none,float32:int8",
                         "--out", str(tmp_path / "q.json")])
    f32, int8 = out["results"]
    assert (f32["quantize"], int8["quantize"]) == ("none", "int8")
    assert all(0 < r["ms_per_step"] < 10_000 for r in out["results"]), out
    assert int8["weight_bytes"] < 0.3 * f32["weight_bytes"]       # int8 kernels, float32 rest
    assert (tmp_path / "q.json").exists()


def test_int8_cache_against_the_float_cache(tmp_path):
    from benchmarks.quantized import kv_int8
    out = kv_int8.main(["--dtypes", "float32", "--tokens", "8", "--slots", "2", "--chunks", "1",
                        "--out", str(tmp_path / "kv.json")])
    row, = out["results"]
    assert row["mean_common_prefix"] == 1.0 and 0 < row["mean_kl_per_token"] < 1e-3, row
    assert row["cache_bytes_int8_vs_float"] == round((64 + 4) / (4 * 64), 4)   # head_dim 64
    assert 0 < row["ms_per_step_int8"] < 10_000 and (tmp_path / "kv.json").exists()


def test_heldout_per_scheme_and_its_differences(tmp_path, tiny_demo_model):
    from benchmarks.quantized import quantize_heldout
    out = quantize_heldout.main(["--model", tiny_demo_model, "--schemes", "none,int8", "--items",
                                 "2", "--batch", "2", "--out", str(tmp_path / "h.json")])
    assert set(out["results"]) == {"none", "int8"} and out["model"] == tiny_demo_model
    for scheme in ("none", "int8"):
        regimes = out["results"][scheme]["regimes"]
        assert set(regimes) == {"counting", "arith", "lists", "records", "code"}
        assert all(regimes[k]["verified_equals_ar"] == "2/2" for k in regimes)
    diffs = out["differences"]["int8"]
    for kind, runs in diffs.items():
        for method, d in runs.items():
            r, ref = (out["results"][s]["regimes"][kind][method] for s in ("int8", "none"))
            q = "accuracy" if "accuracy" in r else "nll"
            want = round(100 * (r[q] - ref[q]), 2) if q == "accuracy" else round(r[q] - ref[q], 4)
            assert d == want, (kind, method)
    assert (tmp_path / "h.json").exists()
