"""wedlm-serve's GET /metrics and request log lines, and the batch job's counters: after a known
set of requests the counters equal what the answers served (tokens, requests, cached prompt
tokens), the histograms hold one observation per request in the right buckets (checked against
the answers' own `wedlm` counts), the exposition parses with prometheus_client's parser, and the
API-key rule holds. A paged cache (prefix reuse), a tiny random checkpoint, the app in-process."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from decode import cli  # noqa: E402
from decode.serving import serve  # noqa: E402
from decode.metrics import ServerMetrics  # noqa: E402

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "one two three four five six seven eight nine ten " * 2


@pytest.fixture(scope="module")
def server(ckpt):
    args = serve._parser().parse_args(["--checkpoint", ckpt[0], "--slots", "2", "--window", "4",
                                       "--capacity", "128", "--page-size", "8", "--model-name", "tiny",
                                       "--no-default-stops", "--lazy-compile", "--api-key", KEY])
    engine, app, cfg = serve.build_server(args)
    with TestClient(app) as client:
        yield dict(engine=engine, app=app, cfg=cfg, client=client)
    engine.shutdown(timeout=15)


def scrape(client, headers=AUTH) -> dict:
    """{(sample name, ((label, value), ...) without model_name/method): value} of GET /metrics."""
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "method")))
            out[(s.name, labels)] = s.value
    return out


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def completion(client, **body):
    r = client.post("/v1/completions", headers=AUTH, json=dict(model="tiny", **body))
    assert r.status_code == 200, r.text
    return r.json()


def stream_completion(client, **body):
    """(usage, wedlm stats, finish reason) of a streamed completion with the usage chunk."""
    body = dict(model="tiny", stream=True, stream_options={"include_usage": True}, **body)
    usage = stats = reason = None
    with client.stream("POST", "/v1/completions", headers=AUTH, json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[len("data: "):])
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj["choices"]:
                if c["finish_reason"]:
                    reason, stats = c["finish_reason"], obj["wedlm"]
    return usage, stats, reason


def test_counters_and_histograms_equal_what_was_served(server):
    c = server["client"]
    before = scrape(c)
    served = [completion(c, prompt=PROMPT, max_tokens=6), completion(c, prompt=PROMPT, max_tokens=6)]
    chat = c.post("/v1/chat/completions", headers=AUTH, json=dict(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=5))
    served.append(chat.json())
    usage, stats, reason = stream_completion(c, prompt="the cat sat on the mat", max_tokens=40)
    answers = [(a["usage"], a["wedlm"], a["choices"][0]["finish_reason"]) for a in served]
    assert all(set(w) == {"steps", "token_slots", "p_cache"} for _, w, _ in answers), answers
    answers.append((usage, stats, reason))
    after = scrape(c)
    n = len(answers)
    prompt = sum(u["prompt_tokens"] for u, _, _ in answers)
    out = sum(u["completion_tokens"] for u, _, _ in answers)
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u, _, _ in answers)
    assert cached >= 8          # the repeated prompt's full pages were reused
    assert all(r == "length" for _, _, r in answers)
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == n
    assert delta(after, before, "vllm:prompt_tokens_total") == prompt
    assert delta(after, before, "vllm:generation_tokens_total") == out
    assert delta(after, before, "vllm:prefix_cache_queries_total") == prompt
    assert delta(after, before, "vllm:prefix_cache_hits_total") == cached
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "wedlm:tokens_per_forward", "wedlm:p_cache", "wedlm:forwards_per_request",
                 "vllm:request_prompt_tokens"):
        assert delta(after, before, name + "_count") == n, name
    # per output token: the requests whose tokens came in more than one chunk (the streamed one's did)
    assert 1 <= delta(after, before, "vllm:time_per_output_token_seconds_count") <= n
    assert delta(after, before, "vllm:request_prompt_tokens_sum") == prompt
    assert delta(after, before, "vllm:request_generation_tokens_sum") == out
    # WeDLM's histograms against the answers' own counts (steps: forwards; token_slots: token slots)
    assert delta(after, before, "wedlm:forwards_per_request_sum") == sum(s["steps"] for _, s, _ in answers)
    per_forward = [u["completion_tokens"] / s["steps"] for u, s, _ in answers]
    assert delta(after, before, "wedlm:tokens_per_forward_sum") == pytest.approx(sum(per_forward))
    assert delta(after, before, "wedlm:p_cache_sum") == pytest.approx(sum(s["p_cache"] for _, s, _ in answers))
    for le in ("1.0", "1.5", "2.0", "3.0", "4.0", "+Inf"):
        bound = float("inf") if le == "+Inf" else float(le)
        assert delta(after, before, "wedlm:tokens_per_forward_bucket", le=le) == \
            sum(x <= bound for x in per_forward), le
    # nothing is running now: the gauges read the batcher and the page pool
    assert after[("vllm:num_requests_running", ())] == 0
    assert after[("vllm:num_requests_waiting", ())] == 0
    assert after[("vllm:kv_cache_usage_perc", ())] == 0
    assert not any(name == "wedlm:constrained_requests_total" for name, _ in after)  # none asked
    assert delta(after, before, "wedlm:verified_drafted_tokens_total") == 0   # streaming drafts none


def test_stop_string_is_counted_as_stop(server):
    """A request the server cancels at a stop string finishes 'stop' in the counters as in the
    answer; the tokens it generated past the string are counted as generated."""
    c = server["client"]
    text = completion(c, prompt="hello world", max_tokens=8)["choices"][0]["text"]
    stop = text[2:5]
    assert len(stop) == 3
    before = scrape(c)
    a = completion(c, prompt="hello world", max_tokens=64, stop=[stop])
    # the answer leaves at the stop string; its cancelled slot ends at the engine's next step
    deadline = time.time() + 30
    while (after := scrape(c))[("vllm:num_requests_running", ())] and time.time() < deadline:
        time.sleep(0.05)
    assert a["choices"][0]["finish_reason"] == "stop"
    assert delta(after, before, "vllm:request_success_total", finished_reason="stop") == 1
    assert delta(after, before, "vllm:request_success_total", finished_reason="abort") == 0
    assert delta(after, before, "vllm:prompt_tokens_total") == a["usage"]["prompt_tokens"]
    assert delta(after, before, "vllm:generation_tokens_total") >= a["usage"]["completion_tokens"]


def test_metrics_need_the_key_unless_public(server):
    c = server["client"]
    assert c.get("/metrics").status_code == 401
    assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/health").status_code == 200
    public = serve.build_app(server["engine"], None, dataclasses.replace(server["cfg"], metrics_public=True))
    with TestClient(public) as open_client:
        r = open_client.get("/metrics")
        assert r.status_code == 200 and "vllm:num_requests_running" in r.text
        assert open_client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code == 401


def test_one_log_line_per_request_without_the_prompt(server, caplog):
    c = server["client"]
    metrics = server["engine"].metrics
    secret = "the cat sat on the mat"
    with caplog.at_level(logging.INFO, logger="wedlm-serve"):
        a = completion(c, prompt=secret, max_tokens=4)
    lines = [r.getMessage() for r in caplog.records if "finished:" in r.getMessage()]
    assert len(lines) == 1
    u = a["usage"]
    assert (f"length, prompt {u['prompt_tokens']} tokens (0 cached), completion 4 tokens"
            in lines[0]), lines[0]
    assert "ttft" in lines[0] and "tokens/forward" in lines[0] and secret not in lines[0]
    caplog.clear()
    metrics.log_prompts = True
    try:
        with caplog.at_level(logging.INFO, logger="wedlm-serve"):
            completion(c, prompt=secret, max_tokens=4)
    finally:
        metrics.log_prompts = False
    lines = [r.getMessage() for r in caplog.records if "finished:" in r.getMessage()]
    assert len(lines) == 1 and repr(secret) in lines[0]


def test_gauges_read_the_batcher(server):
    """Running, waiting and KV-cache usage follow a Batcher's slots, queue and page pool."""
    from decode.engine.step.state import Request
    from decode.engine.runtime.batcher import Batcher
    batcher = Batcher(server["engine"].batcher.decoder)      # the server's Decoder, idle meanwhile
    values = ServerMetrics(batcher, "tiny", "streaming").snapshot
    for i in range(3):
        batcher.submit(Request(prompt=(5 + i, 6, 7, 8, 9), max_new_tokens=40))
    v = values()
    assert (v["vllm:num_requests_running"], v["vllm:num_requests_waiting"]) == (0, 3)
    assert v["vllm:kv_cache_usage_perc"] == 0
    batcher.step()
    v = values()
    assert (v["vllm:num_requests_running"], v["vllm:num_requests_waiting"]) == (2, 1)   # 2 slots
    assert 0 < v["vllm:kv_cache_usage_perc"] <= 1
    batcher.run_until_idle()
    v = values()
    assert (v["vllm:num_requests_running"], v["vllm:num_requests_waiting"],
            v["vllm:kv_cache_usage_perc"]) == (0, 0, 0)


def test_registries_are_per_server_and_the_hook_counts(server):
    """A second ServerMetrics in the process neither collides with nor shares the first's values."""
    first = server["engine"].metrics
    other = ServerMetrics(first.batcher, "other", "streaming")
    other.count_constrained("host")
    assert other.snapshot()["wedlm:constrained_requests_total"] == {"host": 1}
    assert "wedlm:constrained_requests_total" not in first.snapshot()


def test_batch_job_writes_the_counters(ckpt, tmp_path, capsys):
    """wedlm-decode --input --metrics-file (verified decoding): the JSON counters equal the
    results file's lines."""
    src = tmp_path / "in.jsonl"
    prompts = ["one two three", "the cat sat on the mat", "hello world, hello there"]
    src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 5 + i}) + "\n" for i, p in enumerate(prompts)))
    out, mf = tmp_path / "out.jsonl", tmp_path / "metrics.json"
    code = cli.main(["--checkpoint", ckpt[0], "--input", str(src), "--output", str(out), "--capacity", "64",
                     "--slots", "2", "--method", "verified", "--no-default-stops", "--metrics-file", str(mf)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "wedlm-decode: metrics: " in err and "vllm:generation_tokens_total=" in err
    assert "vllm:num_requests_running" not in err       # the summary line leaves the gauges out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    m = json.loads(mf.read_text())
    assert m["vllm:request_success_total"] == {"length": len(prompts)}
    assert m["vllm:prompt_tokens_total"] == sum(x["prompt_tokens"] for x in lines)
    assert m["vllm:generation_tokens_total"] == sum(x["completion_tokens"] for x in lines)
    assert m["wedlm:forwards_per_request"]["count"] == len(prompts)
    assert m["wedlm:forwards_per_request"]["sum"] == sum(x["steps"] for x in lines)
    drafted, accepted = m["wedlm:verified_drafted_tokens_total"], m["wedlm:verified_accepted_tokens_total"]
    assert drafted > 0 and 0 <= accepted <= drafted


def test_metrics_file_checked_before_anything_loads(ckpt, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "one two"}\n')
    code = cli.main(["--checkpoint", ckpt[0], "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                     "--metrics-file", str(tmp_path / "nowhere" / "m.json")])
    assert code == 2 and "--metrics-file" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
    code = cli.main(["--checkpoint", ckpt[0], "--prompt", "hi", "--metrics-file", str(tmp_path / "m.json")])
    assert code == 2 and "--metrics-file goes with --input" in capsys.readouterr().err
