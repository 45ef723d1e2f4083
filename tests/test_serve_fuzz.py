"""Fuzz and soak of wedlm-serve: property-based request bodies (hypothesis) against the
request parser and against a live server on 127.0.0.1, which must answer every one of them with
200 or a 4xx naming the problem (never a 500, never a dead engine); then a bounded soak of mixed
valid, invalid, cancelled and oversized requests after which the same greedy prompt returns the
same text, no slot is left in use, and /health answered throughout.

The soak's figures (requests, status mix, RSS growth, /health latency) are printed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from decode.serving import serve  # noqa: E402
from decode.config import Sampling  # noqa: E402
from decode.text import load_tokenizer  # noqa: E402
from tests.live_server import serve_in_thread, tiny_engine  # noqa: E402

CAPACITY = 256
FIELDS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "tau", "lam", "seed", "stop", "stream", "stream_options", "n", "echo",
          "logprobs", "sampling_order", "model", "user")

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
any_text = st.text(st.characters(exclude_categories=()), max_size=40)   # lone surrogates too
prompts = (st.text(max_size=60) | any_text | st.lists(st.integers(-5, 2**40), max_size=12) | json_values)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                                    "tool", "x"]),
                                           "content": st.text(max_size=30) | any_text
                                           | json_values}),
                    max_size=3) | json_values
bodies = st.fixed_dictionaries(
    {}, optional={**{f: json_values for f in FIELDS}, "prompt": prompts, "messages": messages,
                  "max_tokens": st.integers(-3, 2**40) | json_values})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_parser_answers_400_or_parses(ckpt, body):
    """Any JSON body: the parser returns settings and token ids, or raises a 4xx APIError that
    names a message; nothing else escapes."""
    tokenizer = _tokenizer(ckpt[0])
    for parse in (lambda: serve.parse_prompt(body, tokenizer, 100),
                  lambda: serve.parse_messages(body, tokenizer)):
        try:
            serve.parse_settings(body, Sampling(max_new_tokens=16))
            ids = parse()
            assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
        except serve.APIError as e:
            assert 400 <= e.status < 500 and e.message


_TOKENIZERS: dict = {}


def _tokenizer(path):
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = load_tokenizer(path)
    return _TOKENIZERS[path]


@pytest.fixture(scope="module")
def live(ckpt):
    engine, batcher, tokenizer, cfg = tiny_engine(ckpt[0], CAPACITY)
    app = serve.build_app(engine, tokenizer, cfg)
    url, srv, thread, sock = serve_in_thread(app, log_level="error")
    with httpx.Client(base_url=url, timeout=60) as client:
        yield dict(client=client, engine=engine, batcher=batcher)
    srv.should_exit = True
    thread.join(15)
    engine.shutdown(timeout=15)
    sock.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans(), named=st.booleans())
def test_live_server_never_answers_500(live, body, chat, named):
    if named:                      # half the bodies name the model, so more reach the engine
        body = dict(body, model="tiny")
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 0:
        body = dict(body, max_tokens=min(body["max_tokens"], 8))   # keep each decode short
    body.pop("max_completion_tokens", None)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = live["client"].post(path, content=json.dumps(body, allow_nan=True))
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert r.json()["error"]["message"]
    assert live["engine"].error is None
    assert live["client"].get("/health").status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "one \ud800 two"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udfff"}]}, "messages"),
    ("/v1/completions", {"prompt": "one", "stop": ["\udc80"]}, "stop"),
    ("/tokenize", {"prompt": "x\ud83d"}, "prompt"),
])
def test_invalid_unicode_is_a_400_naming_the_field(live, path, body, param):
    """A lone surrogate (a JSON escape no UTF-8 text holds) is the client's error, named."""
    r = live["client"].post(path, content=json.dumps(dict(body, model="tiny", max_tokens=4)))
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and "not valid Unicode" in err["message"], err
    assert live["engine"].error is None


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_bounded_soak_leaves_the_server_as_it_was(live):
    c = live["client"]
    probe = {"model": "tiny", "prompt": "the same prompt", "max_tokens": 12, "tau": 0.0}
    before = c.post("/v1/completions", json=probe).json()["choices"][0]["text"]
    rss0 = _rss_kib()
    kinds = ["ok", "stream", "bad", "huge", "cancel", "chat", "nested", "long"]
    status: dict = {}
    health_ms: list = []
    stop = threading.Event()

    def prober():
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            health_ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.05)

    def one(i):
        kind = kinds[i % len(kinds)]
        with httpx.Client(base_url=str(c.base_url), timeout=60) as own:
            if kind == "ok":
                r = own.post("/v1/completions", json={"model": "tiny", "prompt": f"request {i}", "max_tokens": 8})
            elif kind == "stream":
                with own.stream("POST", "/v1/completions", json={
                        "model": "tiny", "prompt": f"s {i}", "max_tokens": 8, "stream": True}) as r:
                    lines = [ln for ln in r.iter_lines() if ln]
                    assert lines[-1] == "data: [DONE]", lines[-2:]
            elif kind == "bad":
                r = own.post("/v1/completions", json={"model": "tiny", "prompt": "x", "top_k": 2**40})
            elif kind == "huge":
                r = own.post("/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"a" * 100_000 + b'"}')
            elif kind == "cancel":
                try:
                    own.post("/v1/completions", json={"model": "tiny", "prompt": "c", "max_tokens": 200},
                             timeout=0.05)
                except httpx.TimeoutException:
                    pass
                return "cancelled"
            elif kind == "chat":
                r = own.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}],
                    "max_tokens": 6})
            elif kind == "nested":
                r = own.post("/v1/completions", content=b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000
                             + b"}")
            else:
                r = own.post("/v1/completions", json={"model": "tiny", "prompt": "z " * 300, "max_tokens": 8})
            return r.status_code

    probe_thread = threading.Thread(target=prober, daemon=True)
    probe_thread.start()
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for code in pool.map(one, range(160)):
            status[code] = status.get(code, 0) + 1
    stop.set()
    probe_thread.join(10)
    wall = time.time() - t0
    deadline = time.time() + 30                        # cancelled requests drain
    while live["batcher"].num_active + live["batcher"].num_waiting and time.time() < deadline:
        time.sleep(0.05)
    after = c.post("/v1/completions", json=probe).json()["choices"][0]["text"]
    rss1 = _rss_kib()
    health_ms.sort()
    p99 = health_ms[min(len(health_ms) - 1, int(0.99 * len(health_ms)))]
    print(f"soak: 160 requests in {wall:.1f} s, status {dict(sorted(status.items(), key=str))}, "
          f"RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB, /health p99 {p99:.1f} ms "
          f"({len(health_ms)} probes)")
    assert after == before
    assert 500 not in status and live["engine"].error is None
    assert status.get(200, 0) >= 40 and status.get(400, 0) >= 20 and status.get(413, 0) >= 20
    assert live["batcher"].num_active == 0 and live["batcher"].num_waiting == 0
    assert rss1 - rss0 < 200 * 1024, (rss0, rss1)
