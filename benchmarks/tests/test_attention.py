"""benchmarks.training.attention at toy size: the tiled (tile-skipping) and the dense dual-stream attention
compute the same gradients, and the tiled one visits only the tile pairs the mask allows."""

from __future__ import annotations

import json

from benchmarks.training import attention


def test_tiled_and_dense_forward_backward_side_by_side(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    rows = attention.main(["--lengths", "128", "--tile", "32", "--reps", "1", "--heads", "2",
                           "--kv-heads", "1", "--head-dim", "16", "--json", str(out)])
    (r,) = rows
    assert (r["L"], r["slots"], r["tile"]) == (128, 256, 32)
    assert r["max_rel_err"] < 1e-4                       # the same d/d(q, k, v)
    # 8 x 8 tile pairs; a 32-token block's slots see the memory stream before it and their own
    # block: about a quarter of the dense square is computed, never more than half
    assert 0.25 <= r["computed_fraction"] < 0.5, r
    assert 0.0 < r["mask_density"] < r["computed_fraction"]
    assert r["tiled_s"] > 0 and r["dense_s"] > 0 and r["speedup"] == r["dense_s"] / r["tiled_s"]
    assert 0 < r["tiled_peak_bytes"] < r["dense_peak_bytes"]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert "| 128 | 256 |" in capsys.readouterr().out
