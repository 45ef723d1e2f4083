"""benchmarks.decoding.verified at toy size (--quick): verified streaming gives AR greedy's tokens in every
regime, with more than one token per forward where the two readings agree."""

from __future__ import annotations

import json

from benchmarks.decoding import verified


def test_verified_equals_ar_in_every_regime(tmp_path):
    path = tmp_path / "verified.json"
    verified.main(["--quick", "--repeats", "1", "--train-steps", "20", "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["counting_training"]["steps"] == 20 and out["counting_training"]["final_loss"] > 0
    assert set(out["regimes"]) == {"counting", "plain", "agree"}
    for regime, rows in out["regimes"].items():
        for tau, row in rows.items():
            assert row["ar"]["tokens_per_forward"] == 1.0 and row["ar"]["speedup_over_ar"] == 1.0
            assert row["verified"]["equals_ar"] is True, (regime, tau, row["verified"])
            assert row["verified"]["accepted"] + row["verified"]["rejected"] > 0
    assert out["regimes"]["agree"]["2.0"]["verified"]["tokens_per_forward"] > 1.5
