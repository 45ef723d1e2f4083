"""benchmarks.decoding.window_ladder at toy size on a tiny demo-shaped model: every rung, AR and the
load policy measured at each concurrency, with the ratios the report reads."""

from __future__ import annotations

import json

from benchmarks.decoding import window_ladder


def test_rungs_ar_and_the_policy_at_two_loads(tmp_path, tiny_demo_model):
    path = tmp_path / "wl.json"
    assert window_ladder.main(["--model", tiny_demo_model, "--method", "verified", "--window", "4",
                               "--live", "1,2", "--per-client", "1", "--tokens", "6", "--rounds",
                               "1", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["method"] == "verified" and set(out["results"]) == {"1", "2"}
    for point in out["results"].values():
        rates = point["tokens_per_s"]
        assert set(rates) == {"ar", "W 4", "W 2", "W 1", "load"} and min(rates.values()) > 0
        assert point["best_fixed"] in rates and point["load_over_ar"] == rates["load"] / rates["ar"]
        assert sum(point["policy_calls"].values()) > 0
