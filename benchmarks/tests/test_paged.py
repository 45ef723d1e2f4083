"""benchmarks.decoding.paged at toy size on a demo-shaped model (conftest.py): with prefix reuse a request
takes the shared prefix's whole pages from the cache, the paged pool holds more requests in flight
than dense slots of the same memory, and the step is timed paged against dense."""

from __future__ import annotations

import json

from benchmarks.decoding import paged


def test_prefix_reuse_in_flight_and_step(tmp_path, tiny_demo_model):
    path = tmp_path / "paged.json"
    res = paged.main(["--model", tiny_demo_model, "--rounds", "1", "--questions", "2",
                      "--requests", "6", "--few-shot", "200", "--out", str(path)])
    assert json.loads(path.read_text())["results"] == json.loads(json.dumps(res))
    assert list(res["prefix"]) == ["few-shot 200", "chat"]
    assert res["prefix"]["few-shot 200"]["prefix_tokens"] == 200
    for w in res["prefix"].values():
        whole_pages = w["prefix_tokens"] // paged.PAGE * paged.PAGE
        assert w["on"]["cached_tokens"] == whole_pages      # the second question's prefix
        assert w["on, every slot"]["cached_tokens"] == whole_pages
        assert w["off"]["cached_tokens"] == 0
        assert w["on"]["prompt_tokens"] == w["off"]["prompt_tokens"] > 2 * w["prefix_tokens"]
        assert all(w[m]["ttft_s"] > 0 and w[m]["tokens_per_s"] > 0 for m in ("on", "off"))
    f = res["inflight"]
    assert (f["dense"]["slots"], f["paged"]["slots"]) == (4, 32)
    assert f["dense"]["cache_rows"] == f["paged"]["cache_rows"]          # the same memory
    assert f["dense"]["max_in_flight"] == 4 < f["paged"]["max_in_flight"] <= 6
    for method in ("streaming", "ar"):
        s = res["step"][method]
        assert s["dense"]["ms_per_step"] > 0 and s["paged"]["ms_per_step"] > 0
        assert s["paged_over_dense"] == s["paged"]["ms_per_step"] / s["dense"]["ms_per_step"]
