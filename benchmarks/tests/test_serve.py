"""benchmarks.doors.serve at toy size: a demo-shaped model (conftest.py) behind the real server (a
subprocess), concurrent streaming clients, and one request's time against generate() (the
benchmark checks that both give the same text)."""

from __future__ import annotations

import json

from benchmarks.doors import serve


def test_server_under_load_and_its_overhead(tmp_path, tiny_demo_model):
    path = tmp_path / "serve.json"
    assert serve.main(["--model", tiny_demo_model, "--clients", "2", "--requests", "1",
                       "--overhead-prompts", "1", "--slots", "2", "--capacity", "256",
                       "--json", str(path), "--lazy-compile"]) == 0
    out = json.loads(path.read_text())
    (load,) = out["load"]
    assert load["clients"] == 2 and load["requests"] == 8         # at least 8 requests in all
    assert load["tokens"] > 0 and load["tokens_per_s"] > 0
    assert 0 < load["ttft_p50"] <= load["ttft_p99"] and load["gap_p50"] > 0
    assert set(out["overhead"]) == {"slots=2", "slots=1"}
    for o in out["overhead"].values():
        assert [r["kind"] for r in o["rows"]] == ["counting", "arith", "code"]
        assert all(r["tokens"] > 0 and r["generate_s"] > 0 and r["server_s"] > 0 for r in o["rows"])
