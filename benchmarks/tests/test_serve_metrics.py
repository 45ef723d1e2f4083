"""benchmarks.doors.serve_metrics at toy size: a demo-shaped model (conftest.py) behind the real server
(a subprocess), plain and scraped windows interleaved, the scrapes parsed."""

from __future__ import annotations

import json

import pytest

from benchmarks.doors import serve_metrics

pytest.importorskip("prometheus_client")


def test_scraped_against_plain(tmp_path, tiny_demo_model):
    path = tmp_path / "metrics.json"
    assert serve_metrics.main(["--model", tiny_demo_model, "--rounds", "2", "--clients", "2",
                               "--requests", "1", "--interval", "0.2", "--amplify", "4", "--pin",
                               "--json", str(path), "--lazy-compile"]) == 0
    out = json.loads(path.read_text())
    kinds = out["kinds"]
    assert list(kinds) == ["plain", "every 0.2 s", "every 0.05 s"]
    assert all(len(k["tokens_per_s"]) == 2 and min(k["tokens_per_s"]) > 0 for k in kinds.values())
    assert kinds["plain"]["scrapes"] == 0
    assert kinds["every 0.2 s"]["scrapes"] >= 2 and kinds["every 0.05 s"]["scrapes"] >= 2
    assert kinds["plain"]["overhead"] == 0 and kinds["plain"]["overhead_paired"] == 0
    amp = kinds["every 0.05 s"]
    assert out["overhead_per_scrape_per_s"] == pytest.approx(amp["overhead_paired"] / 4 * 0.2)
    # the server counted every token it generated; the answers may end before a stop token
    assert out["generation_tokens_counted"] >= out["tokens_served"] > 0
    assert 0 < out["recording_s_per_request"] < 0.01 and 0 < out["exposition_s"] < 0.1
    assert all(k["median_cpu_s_per_1k"] > 0 for k in kinds.values())


def test_compare_takes_medians_and_pairs_by_round():
    kinds = {"plain": dict(tokens_per_s=[100.0, 200.0, 150.0], cpu_s_per_1k=[2.0, 2.0, 3.0],
                           scrapes=0),
             "scraped": dict(tokens_per_s=[90.0, 210.0, 120.0], cpu_s_per_1k=[2.2, 2.0, 3.0],
                             scrapes=9)}
    rows = serve_metrics.compare(kinds, "plain")
    s = rows["scraped"]
    assert s["median_tokens_per_s"] == 120.0 and s["overhead"] == pytest.approx(1 - 120 / 150)
    # ratios by round 0.9, 1.05, 0.8: median 0.9
    assert s["overhead_paired"] == pytest.approx(0.1)
    assert s["cpu_overhead"] == pytest.approx(2.2 / 2.0 - 1)
    assert rows["plain"]["overhead"] == 0 and rows["plain"]["scrapes"] == 0
