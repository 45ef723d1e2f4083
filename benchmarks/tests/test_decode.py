"""benchmarks.decoding.decode at toy size (--quick): the engine's step against one jitted forward, the
methods' tokens per forward on random weights, and our AR against transformers' greedy generate
on the same tiny model (the same tokens)."""

from __future__ import annotations

import json

from benchmarks.decoding import decode


def test_engine_overhead_methods_and_transformers(tmp_path):
    path = tmp_path / "decode.json"
    decode.main(["--quick", "--repeats", "1", "--only", "overhead,methods,transformers",
                 "--json", str(path)])
    out = json.loads(path.read_text())
    o = out["overhead"]
    assert o["iterations"] > 0 and o["new_tokens"] == [16, 64]
    assert o["step_wall_s"] > 0 and o["forward_wall_s"] > 0
    assert o["ratio_wall"] == o["step_wall_s"] / o["forward_wall_s"]
    for row in out["methods"].values():
        assert row["ar"]["tokens_per_forward"] == 1.0 and row["ar"]["steps"] == 64
        assert all(row[m]["n_gen"] == 64 for m in ("streaming", "block", "ar"))
    peaky = out["methods"]["head400.0_tau0.4"]       # near-deterministic: parallel fills
    assert peaky["streaming"]["tokens_per_forward"] > 2 and peaky["block"]["tokens_per_forward"] > 2
    for batch in ("batch1", "batch8"):
        t = out["vs_transformers"][batch]
        assert t["same_tokens"] is True, t           # our AR = transformers' greedy, token for token
        assert t["ours_wall_s"] > 0 and t["transformers_wall_s"] > 0
