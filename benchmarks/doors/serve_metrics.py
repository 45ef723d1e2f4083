"""What wedlm-serve's metrics cost: the server's tokens/s with GET /metrics scraped every second
against without, in the same run on the same server, interleaved.

    python -m benchmarks.doors.serve_metrics [--model DIR] [--rounds 16] [--clients 8] [--requests 6]
                                       [--interval 1.0] [--amplify 20] [--pin] [--json out.json]
                                       [--lazy-compile]

One `wedlm-serve` subprocess (benchmarks.doors.serve's, the demo model, streaming W 8, tau 0.6, 8 slots,
capacity 512, the CPU's default pages). Each round runs a window of closed-loop load
(`--clients` streaming clients, `--requests` each, over the demo's held-out prompts) of each
kind: plain, with a scraper fetching /metrics every `--interval` seconds, and (`--amplify K`)
scraped K times as often, the kinds' order rotated by round. A cost too small for the windows'
spread to show at one scrape a second shows K times larger in the third kind, and divided by K
is the cost of one scrape a second. `--pin` puts the server on its own core and this process's
clients on the others, so the load generator does not take the server's CPU. Reported per kind:
the median tokens/s, overhead = 1 - median / plain's median, the paired figure 1 - median over
rounds of (window / that round's plain window), and the server process's CPU seconds per 1,000
tokens (Linux /proc, all its threads). The last scrape is parsed with prometheus_client's
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

from benchmarks.doors.serve import Server, closed_loop, demo_items, tuning_flags


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
    from decode.metrics import ServerMetrics
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


def window(url, items, args, interval: float | None) -> tuple[dict, int, str]:
    """One window of closed-loop load: (its result, scrapes made, the last exposition); scraped
    every `interval` seconds, or not at all (None)."""
    if interval is None:
        return asyncio.run(closed_loop(url, items, args.clients, args.requests)), 0, ""
    return asyncio.run(scraped(url, items, args.clients, args.requests, interval))


def run_windows(srv, items, args, kinds: dict) -> dict:
    """`args.rounds` rounds of one window of each kind ({label: scrape interval or None}), the
    kinds' order rotated each round; per kind its windows' tokens/s, the server's CPU seconds per
    1,000 tokens, and its scrapes; plus the tokens served and the last exposition."""
    out = {k: dict(tokens_per_s=[], cpu_s_per_1k=[], scrapes=0) for k in kinds}
    served, last, labels = 0, "", list(kinds)
    for i in range(args.rounds):
        for label in labels[i % len(labels):] + labels[:i % len(labels)]:
            c0 = cpu_seconds(srv.proc.pid)
            r, n, text = window(srv.url, items, args, kinds[label])
            c1 = cpu_seconds(srv.proc.pid)
            last = text or last
            k = out[label]
            k["tokens_per_s"].append(r["tokens_per_s"])
            k["scrapes"] += n
            served += r["tokens"]
            if c0 is not None and c1 is not None:
                k["cpu_s_per_1k"].append(1000 * (c1 - c0) / r["tokens"])
            print(f"round {i + 1}: {label:<16} {r['tokens_per_s']:.0f} tok/s ({r['tokens']} tokens "
                  f"in {r['wall_s']:.1f} s, {n} scrapes)", flush=True)
    return dict(kinds=out, served=served, last=last)


def compare(kinds: dict, base: str) -> dict:
    """Per kind: median tokens/s and CPU per 1,000 tokens, and their overheads against `base`
    (1 - median / base's median; paired: 1 - median over rounds of window / base's window)."""
    b = kinds[base]
    out = {}
    for label, k in kinds.items():
        row = dict(k, median_tokens_per_s=statistics.median(k["tokens_per_s"]))
        row["overhead"] = 1 - row["median_tokens_per_s"] / statistics.median(b["tokens_per_s"])
        row["overhead_paired"] = 1 - statistics.median(
            x / y for x, y in zip(k["tokens_per_s"], b["tokens_per_s"]))
        if k["cpu_s_per_1k"] and b["cpu_s_per_1k"]:
            row["median_cpu_s_per_1k"] = statistics.median(k["cpu_s_per_1k"])
            row["cpu_overhead"] = row["median_cpu_s_per_1k"] / statistics.median(b["cpu_s_per_1k"]) - 1
        out[label] = row
    return out


def main(argv=None) -> int:
    from demo.eval import DEMO_MODEL
    ap = argparse.ArgumentParser(prog="python -m benchmarks.doors.serve_metrics",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEMO_MODEL)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6, help="requests per client per window")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    ap.add_argument("--amplify", type=int, default=20, help="a third kind of window scraped this "
                    "many times as often (0: none): the cost of one scrape a second, resolved")
    ap.add_argument("--pin", action="store_true", help="the server on the last CPU, the clients "
                    "and scraper on the others (their load off the server's core)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lazy-compile", action="store_true", help="the server compiles on first use")
    args = ap.parse_args(argv)
    items = demo_items(args.model)
    flags = tuning_flags(8, 8, 0.6, 512) + (["--lazy-compile"] if args.lazy_compile else [])
    cpus = sorted(os.sched_getaffinity(0))
    pinned = args.pin and len(cpus) > 1
    if pinned:
        os.sched_setaffinity(0, set(cpus[:-1]))
    srv = Server(args.model, flags, cpus={cpus[-1]} if pinned else None).wait_ready()
    kinds = {"plain": None, f"every {args.interval:g} s": args.interval}
    if args.amplify:
        kinds[f"every {args.interval / args.amplify:g} s"] = args.interval / args.amplify
    try:
        before = generation_total(_get(srv.url + "/metrics"))
        served = asyncio.run(closed_loop(srv.url, items, args.clients, 1))["tokens"]   # warm every path
        run = run_windows(srv, items, args, kinds)
        final = generation_total(_get(srv.url + "/metrics"))
        generation_total(run["last"])                  # the last scrape parses too
    finally:
        srv.stop()
    cost, scrape_s = host_costs()
    rows = compare(run["kinds"], "plain")
    out = dict(pinned=pinned, kinds=rows, recording_s_per_request=cost, exposition_s=scrape_s,
               generation_tokens_counted=final - before, tokens_served=served + run["served"])
    for label, r in rows.items():
        print(f"{label:<16} tokens/s median {r['median_tokens_per_s']:.0f} (overhead "
              f"{100 * r['overhead']:+.1f}%, paired {100 * r['overhead_paired']:+.1f}%), server CPU "
              f"per 1,000 tokens {r.get('median_cpu_s_per_1k', float('nan')):.3f} s "
              f"({100 * r.get('cpu_overhead', float('nan')):+.1f}%), {r['scrapes']} scrapes", flush=True)
    if args.amplify:      # the amplified kind's overhead over its scrape rate, per scrape a second
        amp = rows[list(kinds)[-1]]
        out["overhead_per_scrape_per_s"] = amp["overhead_paired"] / args.amplify * args.interval
        out["cpu_overhead_per_scrape_per_s"] = amp.get("cpu_overhead", float("nan")) / args.amplify * args.interval
        print(f"one scrape a second, from the {args.amplify}x kind: tokens/s "
              f"{100 * out['overhead_per_scrape_per_s']:+.2f}%, server CPU "
              f"{100 * out['cpu_overhead_per_scrape_per_s']:+.2f}%", flush=True)
    print(f"recording {1e6 * cost:.0f} us per request (64 tokens, 8 chunks), an exposition "
          f"{1e3 * scrape_s:.2f} ms; vllm:generation_tokens_total {final - before:.0f} for "
          f"{out['tokens_served']} tokens served", flush=True)
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
