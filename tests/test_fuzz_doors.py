"""A seeded mutation fuzz of the two doors that take text from strangers: wedlm-serve's request
bodies (against a live server on 127.0.0.1) and the batch job's input lines (each checked by the
job's own reader, then the ones it accepts decoded by a real job). Valid seeds are mutated (fields
dropped, values swapped for odd ones, unknown fields, deep nesting, broken JSON, bytes that are not
UTF-8): every input must get 200 or a 4xx naming the problem (the server) or be read or refused
with a message naming the line (the batch job); never a 5xx, never a traceback in the logs, and
the engine stays alive and empty. Bounded: FUZZ_SERVER bodies and FUZZ_LINES lines, each part
stopping at its time budget. The figures (inputs, time, outcomes) are printed; BENCHMARKS.md
section 13 records a run."""

from __future__ import annotations

import collections
import json
import logging
import random
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from decode import cli  # noqa: E402
from decode.config import DecodeConfigError, Sampling  # noqa: E402
from decode.serving import serve  # noqa: E402
from decode.jobs.lines import read_input  # noqa: E402
from decode.text import load_tokenizer  # noqa: E402
from tests.live_server import serve_in_thread, tiny_engine  # noqa: E402

FUZZ_SERVER, FUZZ_LINES = 2000, 3000
BUDGET_S = 10.0                 # per part: the suite's bound, whatever the machine
JOB_LINES = 8                   # the accepted lines one real job decodes
CAPACITY = 64

WEIRD = [None, True, False, 0, -1, 1, 3, 2**31, 2**63, -2**70, 1e308, -1e-308, 0.5,
         float("nan"), float("inf"), -float("inf"), "", "x", "\ud800", "é" * 40, "\x00", "1e3",
         [], {}, [1, 2], [[]], {"a": 1}, [None], ["a", 1], list(range(40)), "tiny", "user"]
SERVER_SEEDS = [
    {"model": "tiny", "prompt": "one two", "max_tokens": 4},
    {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.7, "seed": 3,
     "top_p": 0.9, "top_k": 5},
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    {"model": "tiny", "prompt": "a", "max_tokens": 2, "stop": ["one"], "logprobs": 2, "echo": True},
    {"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True,
     "stream_options": {"include_usage": True}, "tau": 0.3, "lam": 0.1},
    {"model": "tiny", "messages": [{"role": "system", "content": "s"},
                                   {"role": "user", "content": "u"}],
     "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 2},
]
LINE_SEEDS = [
    {"prompt": "a", "max_tokens": 5},
    {"id": "q1", "prompt": "one two", "max_new_tokens": 3, "temperature": 0.5, "seed": 1},
    {"id": 7, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": "one"},
    {"prompt": [3, 4, 5], "tau": 0.2, "lam": 0.05, "top_p": 0.8, "top_k": 3, "max_tokens": 4},
]


def mutate(rng: random.Random, seed: dict):
    """A mutated copy of `seed`: a dict (sent as JSON), or bytes (broken JSON, not UTF-8)."""
    obj = json.loads(json.dumps(seed))
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        keys = list(obj) if isinstance(obj, dict) else []
        if op < 0.35 and keys:
            obj[rng.choice(keys)] = rng.choice(WEIRD)
        elif op < 0.5 and keys:
            del obj[rng.choice(keys)]
        elif op < 0.6:
            obj[rng.choice(["n", "best_of", "foo", "suffix", "logit_bias", "tools", ""])] = \
                rng.choice(WEIRD)
        elif op < 0.7 and keys:
            k = rng.choice(keys)
            obj[k] = rng.choice([[obj[k]], {"v": obj[k]}, [[[[obj[k]]]]]])
        elif op < 0.8:
            field = "prompt" if "prompt" in obj else "messages"
            obj[field] = rng.choice([[rng.randint(-3, 300) for _ in range(rng.randint(0, 8))],
                                     "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(20)),
                                     [{"role": rng.choice(["user", "bot", 3]),
                                       "content": rng.choice(WEIRD)}]])
        elif op < 0.88:
            obj["max_tokens"] = rng.choice([0, 1, 8, CAPACITY, CAPACITY + 1, 2**40, -5, "8"])
        else:
            text = json.dumps(obj, allow_nan=True).encode()
            return rng.choice([text[:rng.randint(0, len(text))], b"\xff\xfe" + text, b"[" * 300,
                               b"null", b"[]", b'"prompt"', bytes(rng.randrange(256)
                                                                  for _ in range(30))])
    return obj


class Problems(logging.Handler):
    """Log records that carry a traceback or are errors (uvicorn's 'Exception in ASGI
    application', the engine's 'engine step failed')."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(self.format(record))


@pytest.fixture
def problems():
    handler = Problems()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


def start_server(path):
    """(url, uvicorn server, thread, socket, engine): the real app on 127.0.0.1, in a thread."""
    engine, _, tokenizer, cfg = tiny_engine(path, CAPACITY)
    url, srv, thread, sock = serve_in_thread(serve.build_app(engine, tokenizer, cfg), log_level="error")
    return url, srv, thread, sock, engine


def test_server_bodies_fuzz(ckpt, problems):
    rng = random.Random(0)
    url, srv, thread, sock, engine = start_server(ckpt[0])
    statuses, sent = collections.Counter(), 0
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            for seed in SERVER_SEEDS:      # the programs they need compiled before the clock runs
                client.post("/v1/chat/completions" if "messages" in seed else "/v1/completions",
                            json=seed).raise_for_status()   # every seed is valid
            t0 = time.perf_counter()
            for i in range(FUZZ_SERVER):
                if time.perf_counter() - t0 > BUDGET_S:
                    break
                body = mutate(rng, rng.choice(SERVER_SEEDS))
                content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True)
                path = "/v1/chat/completions" if rng.random() < 0.4 else "/v1/completions"
                r = client.post(path, content=content, headers={"Content-Type": "application/json"})
                statuses[r.status_code] += 1
                sent += 1
                assert r.status_code < 500, (path, content[:300], r.status_code, r.text[:300])
                if r.status_code >= 400:
                    assert r.json()["error"]["message"], r.text[:300]
            health = client.get("/health").json()
    finally:
        srv.should_exit = True
        thread.join(15)
        engine.shutdown(timeout=15)
        sock.close()
    wall = time.perf_counter() - t0
    print(f"\nserver fuzz: {sent} bodies in {wall:.1f} s; statuses {dict(sorted(statuses.items()))}; "
          f"tracebacks {len(problems.records)}")
    assert not problems.records, problems.records[:3]
    assert health["status"] == "ok" and engine.error is None
    assert health["active"] == 0 and health["pending"] == 0
    assert sent >= min(FUZZ_SERVER, 100) and statuses[200] > 0


def test_batch_job_lines_fuzz(ckpt, problems, tmp_path, capsys):
    """Each mutated line alone through the job's reader: read, or refused with a message naming
    its line; then the first JOB_LINES lines it accepted decoded by one real job (ids renumbered,
    budgets cut to 8 tokens): exit 0 and one result per line."""
    rng = random.Random(1)
    path = ckpt[0]
    tokenizer = load_tokenizer(path)
    outcomes, accepted, t0 = collections.Counter(), [], time.perf_counter()
    src = tmp_path / "line.jsonl"
    for i in range(FUZZ_LINES):
        if time.perf_counter() - t0 > BUDGET_S:
            break
        line = mutate(rng, rng.choice(LINE_SEEDS))
        data = line if isinstance(line, bytes) else json.dumps(line, allow_nan=True).encode()
        src.write_bytes(data.replace(b"\n", b" ") + b"\n")
        try:
            read_input(str(src), tokenizer, Sampling(max_new_tokens=8), [], [], False, CAPACITY,
                       128)
            outcomes["read"] += 1
            accepted.append(line)
        except DecodeConfigError as e:
            assert str(e).startswith((f"{src}:1: ", f"--input {src}")), str(e)
            outcomes["refused, line named"] += 1
    read_s = time.perf_counter() - t0
    lines = []
    for k, line in enumerate(accepted[:JOB_LINES]):      # bytes accepted: the whole JSON text, cut at its end
        line = dict(json.loads(line) if isinstance(line, bytes) else line, id=f"r{k}")
        for key in ("max_tokens", "max_new_tokens"):
            if key in line:
                line[key] = min(line[key], 8)
        lines.append(json.dumps(line))
    job = tmp_path / "job.jsonl"
    job.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    t1 = time.perf_counter()
    code = cli.main(["--checkpoint", path, "--input", str(job), "--output", str(out),
                     "--capacity", str(CAPACITY), "--max-new-tokens", "8", "--slots", "4"])
    err = capsys.readouterr().err
    job_s = time.perf_counter() - t1
    results = [json.loads(x) for x in open(out)]
    print(f"\nbatch job fuzz: {sum(outcomes.values())} lines read in {read_s:.1f} s "
          f"({dict(outcomes)}); {len(lines)} accepted lines decoded by one job in {job_s:.1f} s, "
          f"exit {code}; tracebacks {len(problems.records)}")
    assert code == 0, err[-2000:]
    assert sorted(r["id"] for r in results) == sorted(f"r{k}" for k in range(len(lines)))
    assert "Traceback" not in err and not problems.records, problems.records[:3]
    assert sum(outcomes.values()) >= min(FUZZ_LINES, 500) and outcomes["read"] > 0
