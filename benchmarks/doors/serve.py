"""wedlm-serve under load: the shipped demo model behind the real server (a subprocess on
127.0.0.1), N concurrent streaming clients, and the server's overhead over `generate()`.

    python -m benchmarks.doors.serve [--model DIR] [--clients 1 8 32] [--requests 2] [--slots 8]
                               [--window 8] [--tau 0.6] [--steps-per-call 8] [--json out.json]
                               [--lazy-compile]

Load: the demo's held-out counting / arithmetic / code prompts in turn (max_tokens per regime:
128 / 96 / 64), greedy, streamed (`stream: true`, usage chunk). Each of N clients sends its next
request when the previous one is done (closed loop), `--requests` per client (at least 8 in all).
Reported per N: tokens/s (completion tokens over the wall time from the first request to the
last answer), time to first token (request sent -> first text chunk) and inter-chunk latency
(gap between consecutive text chunks of one request), p50 / p99.

Overhead: one request at a time, non-streamed, to a server started with --slots 1, against
`generate()` (compiled beforehand) on the same prompt in this process; median over the prompts of
(server latency / generate wall time - 1), from the median and from the fastest of the interleaved
runs (the least disturbed on a shared machine). The figure with the load server's --slots is given too
(its decode steps carry all slots, used or not).

--lazy-compile passes the server's --lazy-compile (each program compiled on first use, not before
serving): a quick run through every path, its load figures including compile time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from benchmarks import results_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("counting", "arith", "code")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tuning_flags(slots, window, tau, capacity, steps_per_call=8) -> list[str]:
    return ["--slots", str(slots), "--window", str(window), "--tau", str(tau), "--capacity",
            str(capacity), "--steps-per-call", str(steps_per_call)]


class Server:
    """`python -m decode.serving.serve` on 127.0.0.1 in a subprocess (its own cores, as a deployment
    has), with the given tuning `flags` (none: the defaults a user starts with); its output to
    `log_path` (default: a temporary file), `env` added to this process's environment, pinned to
    the CPU numbers `cpus` (default: wherever the OS runs it)."""

    def __init__(self, model, flags=(), *, log_path: str | None = None, env: dict | None = None,
                 name: str = "the", cpus: set | None = None):
        self.name, self.port = name, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()
        self.t0, self.start_seconds = time.perf_counter(), None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "decode.serving.serve", "--checkpoint", model, "--host",
             "127.0.0.1", "--port", str(self.port), *flags, "--max-queue", "256", "--model-name",
             "demo", "--log-level", "warning"],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            env=dict(os.environ, **(env or {})),
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))

    def tail(self, n: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def wait_ready(self, timeout=600):
        """This server once /ready answers (`start_seconds` set); RuntimeError with its log's
        tail when it exits first or the `timeout` passes."""
        import httpx
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited ({self.proc.returncode}): "
                                   + self.tail())
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    self.start_seconds = round(time.perf_counter() - self.t0, 1)
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} server did not come up in {timeout} s: " + self.tail())

    def stop(self):
        """SIGTERM to its pid (it drains), SIGKILL after 120 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


async def request_once(client, url, item, stream=True) -> dict:
    body = {"model": "demo", "prompt": item["prompt"], "max_tokens": item["max_tokens"], "temperature": 0}
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return dict(latency=time.perf_counter() - t0, tokens=r.json()["usage"]["completion_tokens"],
                    text=r.json()["choices"][0]["text"])
    body.update(stream=True, stream_options={"include_usage": True})
    times, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev["choices"] and ev["choices"][0]["text"]:
                times.append(time.perf_counter())
    end = time.perf_counter()
    return dict(latency=end - t0, ttft=(times[0] - t0) if times else end - t0, tokens=tokens,
                gaps=[b - a for a, b in zip(times, times[1:])])


async def closed_loop(url, items, clients, per_client) -> dict:
    import httpx
    n = max(8, clients * per_client)
    queue = list(range(n))
    results = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def worker():
            while queue:
                i = queue.pop(0)
                results.append(await request_once(client, url, items[i % len(items)]))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    gaps = [g for r in results for g in r["gaps"]]
    ttft = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return dict(clients=clients, requests=n, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99), gap_p50=percentile(gaps, 50),
                gap_p99=percentile(gaps, 99))


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def demo_items(model, n_per_kind=None):
    from demo.eval import REGIMES, eval_items
    per = [eval_items(model, k, n_per_kind) for k in KINDS]
    out = []
    for group in zip(*per):   # counting, arith, code, counting, ...
        for kind, it in zip(KINDS, group):
            out.append(dict(prompt=it["prompt"], max_tokens=REGIMES[kind].max_new_tokens, kind=kind))
    return out


def overhead(model, url, items, window, tau, capacity, reps=5) -> dict:
    """Median over prompts of server latency (one request, non-streamed) / generate() wall - 1."""
    import httpx
    from demo.eval import load_model
    from decode.config import DecodeConfig
    from decode.static.static_batch import generate
    config, params, tok = load_model(model, check=False)
    stops = tuple(tok.default_stop_ids(config.eos_token_id))
    rows = []

    async def serve_once(item):
        async with httpx.AsyncClient(timeout=600) as client:
            return await request_once(client, url, item, stream=False)

    for item in items:
        ids = tok.encode(item["prompt"])
        dc = DecodeConfig(window=window, tau=tau, max_new_tokens=item["max_tokens"], stop_token_ids=stops)
        generate(params, config, [ids], dc, capacity=capacity)          # compile
        asyncio.run(serve_once(item))                                   # warm
        gen, srv = [], []
        for _ in range(reps):        # interleaved, so a change of machine load hits both
            gen.append(generate(params, config, [ids], dc, capacity=capacity))
            srv.append(asyncio.run(serve_once(item)))
        if tok.decode(gen[0].tokens[0]) != srv[0]["text"]:
            raise RuntimeError(f"server and generate() disagree on {item['prompt']!r}")
        g, s = [r.wall_s for r in gen], [r["latency"] for r in srv]
        rows.append(dict(kind=item["kind"], tokens=len(gen[0].tokens[0]), generate_s=statistics.median(g),
                         server_s=statistics.median(s), overhead=statistics.median(s) / statistics.median(g) - 1,
                         overhead_best=min(s) / min(g) - 1))
    # on a shared machine the fastest of the interleaved runs is the least disturbed one
    return dict(median_overhead=statistics.median(r["overhead"] for r in rows),
                best_overhead=statistics.median(r["overhead_best"] for r in rows), rows=rows)


def main(argv=None) -> int:
    from demo.eval import DEMO_MODEL
    ap = argparse.ArgumentParser(prog="python -m benchmarks.doors.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEMO_MODEL)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=2, help="requests per client (at least 8 in all)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--steps-per-call", type=int, default=8)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--tau", type=float, default=0.6)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--overhead-prompts", type=int, default=2, help="prompts per regime for the overhead")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lazy-compile", action="store_true",
                    help="servers compile on first use (a quick run; load figures include compiles)")
    args = ap.parse_args(argv)
    lazy = ["--lazy-compile"] if args.lazy_compile else []
    items = demo_items(args.model)
    out = dict(load=[], overhead={})
    srv = Server(args.model, tuning_flags(args.slots, args.window, args.tau, args.capacity,
                                          args.steps_per_call) + lazy).wait_ready()
    try:
        asyncio.run(closed_loop(srv.url, items, 1, 1))              # warm the connection path
        for c in args.clients:
            r = asyncio.run(closed_loop(srv.url, items, c, args.requests))
            out["load"].append(r)
            print(f"{c:>3} clients: {r['requests']} requests, {r['tokens']} tokens, {r['tokens_per_s']:.0f} tok/s, "
                  f"TTFT p50 {1e3 * r['ttft_p50']:.0f} ms p99 {1e3 * r['ttft_p99']:.0f} ms, inter-chunk p50 "
                  f"{1e3 * r['gap_p50']:.0f} ms p99 {1e3 * r['gap_p99']:.0f} ms", flush=True)
        few = demo_items(args.model, args.overhead_prompts)
        out["overhead"][f"slots={args.slots}"] = overhead(args.model, srv.url, few, args.window, args.tau,
                                                          args.capacity)
    finally:
        srv.stop()
    one = Server(args.model, tuning_flags(1, args.window, args.tau, args.capacity,
                                          args.steps_per_call) + lazy).wait_ready()
    try:
        out["overhead"]["slots=1"] = overhead(args.model, one.url, few, args.window, args.tau, args.capacity)
    finally:
        one.stop()
    for key, o in out["overhead"].items():
        print(f"overhead over generate(), one request, server {key}: median {100 * o['median_overhead']:+.1f}% "
              f"(fastest runs: {100 * o['best_overhead']:+.1f}%), "
              + ", ".join(f"{r['kind']} {1e3 * r['generate_s']:.0f}->{1e3 * r['server_s']:.0f} ms"
                          for r in o["rows"]))
    results_file.write(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
