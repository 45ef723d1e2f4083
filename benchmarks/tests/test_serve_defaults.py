"""benchmarks.doors.serve_defaults at toy size: the three servers (no tuning flags, the dense cache,
sized for one request) on a tiny demo-shaped model, interleaved; they agree on every greedy text
(the benchmark raises otherwise) and every figure the report reads is there."""

from __future__ import annotations

import json

from benchmarks.doors import serve_defaults


def test_three_servers_side_by_side(tmp_path, tiny_demo_model):
    path = tmp_path / "sd.json"
    assert serve_defaults.main(["--model", tiny_demo_model, "--rounds", "1", "--concurrent", "2",
                                "--prefix-tokens", "40", "--items", "1", "--lazy-compile", "--json",
                                str(path)]) == 0
    out = json.loads(path.read_text())
    assert set(out["lone"]) == {"default", "dense", "sized"}
    assert all(v["median_s"] > 0 and len(v["per_item_s"]) == len(out["lone"]["sized"]["per_item_s"])
               for v in out["lone"].values())
    assert len(out["lone"]["sized"]["per_item_s"]) == 3          # one a regime
    assert set(out["shared"]) == set(out["load"]) == {"default", "dense"}
    assert out["lone_default_over_sized"] > 0 and out["shared_dense_over_default"] > 0
    assert all(v["tokens_per_s"] > 0 and 0 < v["ttft_p50"] <= v["ttft_p99"] for v in out["load"].values())
