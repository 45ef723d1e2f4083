"""benchmarks.decoding.batching at toy size on a demo-shaped model (conftest.py): static, continuous and
paged continuous batching decode the same requests, every one to its whole budget."""

from __future__ import annotations

import json

from benchmarks.decoding import batching
from demo.eval import load_model


def test_static_continuous_and_paged_decode_every_budget(tmp_path, tiny_demo_model):
    path = tmp_path / "batching.json"
    assert batching.main(["--model", tiny_demo_model, "--requests", "4", "--slots", "2",
                          "--repeats", "1", "--window", "4", "--page-size", "16",
                          "--out", str(path)]) == 0
    out = json.loads(path.read_text())
    _, _, tok = load_model(tiny_demo_model)
    budget = sum(r.max_new_tokens for r in batching.make_requests(tok, 4, model=tiny_demo_model))
    assert set(out["results"]) == {"streaming", "ar"}
    for row in out["results"].values():
        assert row["static"]["tokens"] == row["continuous"]["tokens"] == row["paged"]["tokens"] \
            == budget
        assert all(row[m]["tokens_per_s"] > 0 for m in ("static", "continuous", "paged"))
        assert row["ratio"] == row["continuous"]["tokens_per_s"] / row["static"]["tokens_per_s"]
