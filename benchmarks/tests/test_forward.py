"""benchmarks.training.forward at toy size: our jitted forward and transformers' on the same random weights
give the same logits, each timed."""

from __future__ import annotations

from benchmarks.training import forward


def test_ours_and_transformers_forward_same_logits():
    rows = forward.main(["--batches", "1", "2", "--seq", "16", "--repeats", "2", "--hidden", "128",
                         "--layers", "1", "--vocab", "128"])
    assert [(r["batch"], r["seq"]) for r in rows] == [(1, 16), (2, 16)]
    for r in rows:
        assert r["max_logit_diff"] < 1e-4, r
        assert r["ours_s"] > 0 and r["transformers_s"] > 0
