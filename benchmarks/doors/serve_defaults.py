"""Serving defaults a user can keep: wedlm-serve started with no tuning flags, side by side with
the dense cache the server used to default to on CPU and GPU, and with a server sized for one
request.

    python -m benchmarks.doors.serve_defaults [--model DIR] [--rounds 5] [--concurrent 64]
                                        [--prefix-tokens 1000] [--items 2] [--json out.json]
                                        [--lazy-compile]

Three servers on 127.0.0.1 (subprocesses), the shipped demo model:
  default   no tuning flags (16 slots, capacity 2048, the platform's cache for a serving door:
            on CPU pages of 16 rows, live-slot buckets, prefix reuse)
  dense     the same with --page-size 0: the dense cache, every slot stepped at every step,
            no prefix reuse
  sized     --slots 1 --capacity 512 --page-size 0: sized for one request

Measured, interleaved (default, dense, sized, default, ...), medians over rounds:
  lone      one non-streamed request of up to 32 tokens at a time (the demo's held-out counting,
            arithmetic and code prompts in turn): latency; the target is default <= 1.5x sized
  shared    requests that share a few-shot prefix of --prefix-tokens tokens (worked examples,
            then a held-out question), sent one after another, streamed: time to first token
  load      --concurrent clients each sending one streamed request at once (closed loop):
            tokens/s and time to first token p50 / p99, default against dense
Every request is greedy, and the servers must agree on its text. --lazy-compile passes the
servers' own flag (programs compiled on first use; round 0, not kept, meets them): the smoke
test's quick start.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

from benchmarks.doors.serve import Server, closed_loop, demo_items, request_once
from benchmarks import results_file

SHORT = 32          # new tokens of a lone or shared-prefix request
SERVERS = {"default": [], "dense": ["--page-size", "0"],
           "sized": ["--slots", "1", "--capacity", "512", "--page-size", "0"]}


async def _send(url: str, item: dict, stream: bool) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=600) as client:
        return await request_once(client, url, item, stream=stream)


def interleaved(servers: dict, items: list, rounds: int, stream: bool, key: str) -> dict:
    """{server: [the median over rounds of `key` per item]}, the servers taking turns per request;
    a RuntimeError when two servers answer one item with different text."""
    per = {name: [[] for _ in items] for name in servers}
    for r in range(rounds + 1):                   # round 0 warms every path, not kept
        for i, item in enumerate(items):
            texts = {}
            for name, srv in servers.items():
                out = asyncio.run(_send(srv.url, item, stream))
                texts[name] = out.get("text")
                if r:
                    per[name][i].append(out[key])
            if not stream and len(set(texts.values())) > 1:
                raise RuntimeError(f"the servers disagree on {item['prompt'][:60]!r}: {texts}")
    return {name: [statistics.median(x) for x in rows] for name, rows in per.items()}


def shared_prefix_items(model: str, prefix_tokens: int, n: int) -> list[dict]:
    """n requests of one few-shot prefix (held-out worked examples, repeated to about
    `prefix_tokens` tokens) and a held-out question each."""
    from demo.eval import eval_items
    from wedlm_jax.tokenizer import load_tokenizer
    tok = load_tokenizer(model)
    items = eval_items(model, "counting") + eval_items(model, "arith")
    shots = "\n\n".join(it["prompt"] + it["target"] for it in items[:40:5]) + "\n\n"
    prefix = shots * max(1, prefix_tokens // max(1, len(tok.encode(shots))))
    return [dict(prompt=prefix + it["prompt"], max_tokens=SHORT, kind="shared")
            for it in items[40:40 + n]]


def measure(model: str, rounds: int, concurrent: int, prefix_tokens: int,
            extra_flags: tuple = (), items: int = 2) -> dict:
    """The three servers side by side: `items` lone requests per regime, 2 x `items` shared-prefix
    requests, the load run."""
    servers = {name: Server(model, [*flags, *extra_flags]) for name, flags in SERVERS.items()}
    try:
        for srv in servers.values():
            srv.wait_ready()
        lone_items = [dict(it, max_tokens=SHORT) for it in demo_items(model, items)]
        lone = interleaved(servers, lone_items, rounds, False, "latency")
        shared = interleaved({k: servers[k] for k in ("default", "dense")},
                             shared_prefix_items(model, prefix_tokens, 2 * items), rounds, True,
                             "ttft")
        load = {}
        for r in range(max(1, rounds // 2)):
            for name in ("default", "dense"):
                out = asyncio.run(closed_loop(servers[name].url, demo_items(model), concurrent, 1))
                load.setdefault(name, []).append(out)
    finally:
        for srv in servers.values():
            srv.stop()
    med = lambda xs: statistics.median(xs)
    return dict(
        lone={name: dict(median_s=med(v), per_item_s=v) for name, v in lone.items()},
        lone_default_over_sized=med(a / b for a, b in zip(lone["default"], lone["sized"])),
        lone_dense_over_sized=med(a / b for a, b in zip(lone["dense"], lone["sized"])),
        shared={name: dict(ttft_median_s=med(v), per_item_s=v) for name, v in shared.items()},
        shared_dense_over_default=med(b / a for a, b in zip(shared["default"], shared["dense"])),
        load={name: dict(tokens_per_s=med(r["tokens_per_s"] for r in runs),
                         ttft_p50=med(r["ttft_p50"] for r in runs),
                         ttft_p99=med(r["ttft_p99"] for r in runs), runs=runs)
              for name, runs in load.items()},
        settings=dict(rounds=rounds, concurrent=concurrent, prefix_tokens=prefix_tokens,
                      servers=SERVERS))


def report(out: dict) -> str:
    lone, sh, ld = out["lone"], out["shared"], out["load"]
    return "\n".join([
        "lone request latency (median): " + ", ".join(
            f"{k} {1e3 * v['median_s']:.0f} ms" for k, v in lone.items())
        + f"; default / sized {out['lone_default_over_sized']:.2f}x (target <= 1.5x), dense / sized "
          f"{out['lone_dense_over_sized']:.2f}x",
        "shared prefix, time to first token: " + ", ".join(
            f"{k} {1e3 * v['ttft_median_s']:.0f} ms" for k, v in sh.items())
        + f"; dense / default {out['shared_dense_over_default']:.2f}x",
        f"{out['settings']['concurrent']} concurrent requests: " + ", ".join(
            f"{k} {v['tokens_per_s']:.0f} tok/s (TTFT p50 {1e3 * v['ttft_p50']:.0f} ms, p99 "
            f"{1e3 * v['ttft_p99']:.0f} ms)" for k, v in ld.items())])


def main(argv=None) -> int:
    from demo.eval import DEMO_MODEL
    ap = argparse.ArgumentParser(prog="python -m benchmarks.doors.serve_defaults",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEMO_MODEL)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--items", type=int, default=2,
                    help="lone requests per regime (shared-prefix requests: twice as many)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lazy-compile", action="store_true",
                    help="the servers compile each program on first use (quick start; tests)")
    args = ap.parse_args(argv)
    out = measure(args.model, args.rounds, args.concurrent, args.prefix_tokens,
                  ("--lazy-compile",) if args.lazy_compile else (), args.items)
    print(report(out))
    results_file.write(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
