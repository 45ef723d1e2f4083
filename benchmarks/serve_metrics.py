"""What wedlm-serve's metrics cost: the server's tokens/s with GET /metrics scraped every second
against without, in the same run on the same server, interleaved.

    python -m benchmarks.serve_metrics [--model DIR] [--rounds 16] [--clients 8] [--requests 6]
                                       [--interval 1.0] [--json out.json] [--lazy-compile]

One `wedlm-serve` subprocess (benchmarks.serve's, the demo model, streaming W 8, tau 0.6, 8 slots,
capacity 512, the CPU's default pages). Each round runs two windows of closed-loop load
(`--clients` streaming clients, `--requests` each, over the demo's held-out prompts), one plain
and one with a scraper fetching /metrics every `--interval` seconds, their order alternating by
round. Reported: tokens/s per window, the medians of each kind, overhead = 1 - median(scraped) /
median(plain), the paired figure 1 - median over rounds of (scraped / plain), and the server
process's CPU seconds per 1,000 tokens by kind (Linux /proc, all its threads; on a machine other
processes load, steadier than the wall clock). The last scrape is parsed with prometheus_client's
parser, and the generation counter's growth over the run is printed beside the completion tokens
the clients were served.

Also, timed in this process without a device: the recording cost per request
(`ServerMetrics.counting` and `finished` on a request of 64 tokens in 8 chunks) and one
exposition's (what a scrape costs the server), the host work behind the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import types

from benchmarks.serve import Server, closed_loop, demo_items, tuning_flags


async def scraped(url, items, clients, per_client, interval) -> tuple[dict, int, str]:
    """(closed_loop's result, scrapes made, the last exposition) with a scraper running alongside."""
    import httpx
    done = asyncio.Event()
    state = {"n": 0, "text": ""}

    async def scraper():
        async with httpx.AsyncClient(timeout=30) as client:
            while not done.is_set():
                r = await client.get(url + "/metrics")
                r.raise_for_status()
                state["n"] += 1
                state["text"] = r.text
                try:
                    await asyncio.wait_for(done.wait(), timeout=interval)
                except asyncio.TimeoutError:
                    pass

    task = asyncio.create_task(scraper())
    try:
        result = await closed_loop(url, items, clients, per_client)
    finally:
        done.set()
        await task
    return result, state["n"], state["text"]


def cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU seconds so far (all its threads; Linux /proc), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def generation_total(text: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:generation_tokens_total":
                return s.value
    raise RuntimeError("the exposition has no vllm:generation_tokens_total")


def host_costs(reps: int = 2000) -> tuple[float, float]:
    """(seconds the metrics take on the engine thread per request of 64 tokens in 8 chunks,
    seconds one exposition takes), timed in this process."""
    from decode.serving.metrics import ServerMetrics
    batcher = types.SimpleNamespace(num_active=0, num_waiting=0, pool=None, prefix_reuse=False,
                                    decoder=types.SimpleNamespace(slots=8))
    m = ServerMetrics(batcher, "demo", "streaming")
    request = types.SimpleNamespace(prompt=tuple(range(100)))
    fin = types.SimpleNamespace(request_id=0, tokens=list(range(64)), finish="length", steps=20,
                                n_fwd=160, accepted=0, rejected=0, cached_tokens=0, preempted=0, error=None)
    chunk = list(range(8))
    t0 = time.perf_counter()
    for _ in range(reps):
        track = m.track(request)
        on_tokens = m.counting(track, None)
        for _ in range(8):
            on_tokens(0, chunk)
        m.finished(track, fin)
    per_request = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps // 10):
        m.exposition()
    return per_request, (time.perf_counter() - t0) / (reps // 10)


def main(argv=None) -> int:
    from demo.eval import DEMO_MODEL
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_metrics",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEMO_MODEL)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6, help="requests per client per window")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lazy-compile", action="store_true", help="the server compiles on first use")
    args = ap.parse_args(argv)
    items = demo_items(args.model)
    flags = tuning_flags(8, 8, 0.6, 512) + (["--lazy-compile"] if args.lazy_compile else [])
    srv = Server(args.model, flags).wait_ready()
    plain, with_scrapes, scrapes, served, last = [], [], 0, 0, ""
    cpu = {False: [], True: []}      # the server's CPU seconds per 1,000 tokens, by window kind
    try:
        before = generation_total(_get(srv.url + "/metrics"))
        served += asyncio.run(closed_loop(srv.url, items, args.clients, 1))["tokens"]   # warm every path
        for i in range(args.rounds):
            for scrape in ((False, True) if i % 2 == 0 else (True, False)):
                c0 = cpu_seconds(srv.proc.pid)
                if scrape:
                    r, n, last = asyncio.run(scraped(srv.url, items, args.clients, args.requests,
                                                     args.interval))
                    with_scrapes.append(r["tokens_per_s"])
                    scrapes += n
                else:
                    r = asyncio.run(closed_loop(srv.url, items, args.clients, args.requests))
                    plain.append(r["tokens_per_s"])
                served += r["tokens"]
                c1 = cpu_seconds(srv.proc.pid)
                if c0 is not None and c1 is not None:
                    cpu[scrape].append(1000 * (c1 - c0) / r["tokens"])
                print(f"round {i + 1}: {'scraped' if scrape else 'plain  '} {r['tokens_per_s']:.0f} tok/s "
                      f"({r['tokens']} tokens in {r['wall_s']:.1f} s)", flush=True)
        final = generation_total(_get(srv.url + "/metrics"))
        generation_total(last)                  # the last scrape parses too
    finally:
        srv.stop()
    cost, scrape_s = host_costs()
    out = dict(plain=plain, scraped=with_scrapes, scrapes=scrapes, median_plain=statistics.median(plain),
               median_scraped=statistics.median(with_scrapes), recording_s_per_request=cost,
               exposition_s=scrape_s,
               generation_tokens_counted=final - before, tokens_served=served)
    out["overhead"] = 1 - out["median_scraped"] / out["median_plain"]
    out["overhead_paired"] = 1 - statistics.median(s / p for s, p in zip(with_scrapes, plain))
    if cpu[False] and cpu[True]:
        out.update(cpu_s_per_1k_plain=statistics.median(cpu[False]),
                   cpu_s_per_1k_scraped=statistics.median(cpu[True]))
        out["cpu_overhead"] = out["cpu_s_per_1k_scraped"] / out["cpu_s_per_1k_plain"] - 1
        print(f"server CPU per 1,000 tokens, median: plain {out['cpu_s_per_1k_plain']:.3f} s, scraped "
              f"{out['cpu_s_per_1k_scraped']:.3f} s: {100 * out['cpu_overhead']:+.1f}%", flush=True)
    print(f"tokens/s, median of {args.rounds}: plain {out['median_plain']:.0f}, scraped every "
          f"{args.interval:g} s {out['median_scraped']:.0f} ({scrapes} scrapes): overhead "
          f"{100 * out['overhead']:+.1f}% (paired by round: {100 * out['overhead_paired']:+.1f}%); "
          f"recording {1e6 * cost:.0f} us per request (64 tokens, 8 chunks), an exposition "
          f"{1e3 * scrape_s:.2f} ms; "
          f"vllm:generation_tokens_total {final - before:.0f} for {served} tokens served", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _get(url: str) -> str:
    import httpx
    r = httpx.get(url, timeout=30)
    r.raise_for_status()
    return r.text


if __name__ == "__main__":
    sys.exit(main())
