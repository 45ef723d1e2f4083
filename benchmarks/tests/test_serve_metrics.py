"""benchmarks.serve_metrics at toy size: a demo-shaped model (conftest.py) behind the real server
(a subprocess), plain and scraped windows interleaved, the scrapes parsed."""

from __future__ import annotations

import json

import pytest

from benchmarks import serve_metrics

pytest.importorskip("prometheus_client")


def test_scraped_against_plain(tmp_path, tiny_demo_model):
    path = tmp_path / "metrics.json"
    assert serve_metrics.main(["--model", tiny_demo_model, "--rounds", "1", "--clients", "2",
                               "--requests", "1", "--interval", "0.2", "--json", str(path),
                               "--lazy-compile"]) == 0
    out = json.loads(path.read_text())
    assert len(out["plain"]) == len(out["scraped"]) == 1 and out["scrapes"] >= 1
    assert all(x > 0 for x in out["plain"] + out["scraped"])
    assert out["overhead"] == pytest.approx(1 - out["median_scraped"] / out["median_plain"])
    assert out["overhead_paired"] == pytest.approx(1 - out["scraped"][0] / out["plain"][0])
    # the server counted every token it generated; the answers may end before a stop token
    assert out["generation_tokens_counted"] >= out["tokens_served"] > 0
    assert 0 < out["recording_s_per_request"] < 0.01 and 0 < out["exposition_s"] < 0.1
    assert out["cpu_s_per_1k_plain"] > 0 and out["cpu_s_per_1k_scraped"] > 0
