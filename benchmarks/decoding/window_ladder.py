"""The window sized to the load: committed tokens/s of AR, each fixed rung of the window ladder and
the load policy (decode/engine/runtime/window_policy.py), at several concurrencies, on the demo model.

    python -m benchmarks.decoding.window_ladder [--method verified] [--window 16] [--live 1,4,16]
        [--per-client 2] [--tokens 64] [--rounds 3] [--json FILE]

One Decoder per method with `max(--live)` slots (the paged cache, as the serving doors use): at
each concurrency c, c closed-loop clients (a client submits its next request once its last one
finished, checked between device calls) send `--per-client` held-out prompts each (counting,
arithmetic, lists, code in turn), `--tokens` new tokens, eos as a stop. Every rung and the policy
run on the same Decoder; AR on its own. Every program is compiled first (`Batcher.warm_up`, every
rung at every live-slot bucket); the policy is one object for the whole run (as a server
holds one): what it measured at one concurrency it keeps at the next. A first round is not counted (the policy learns
in it); the rounds interleave the runs; medians are kept. Prints a table and writes --json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from demo.eval import DEMO_MODEL, eval_items, load_model, stop_ids
from demo.eval import REGIMES


class Fixed:
    """Every call at one rung (a policy object: choose / record)."""

    def __init__(self, window: int):
        self.window = window

    def choose(self, live: int) -> int:
        return self.window

    def record(self, *args) -> None:
        pass


def make_requests(tok, config, n: int, tokens: int, model: str = DEMO_MODEL):
    from decode.engine.step.state import Request
    stops = stop_ids(tok, config, REGIMES["counting"])
    kinds = ("counting", "arith", "lists", "code")
    items = {k: eval_items(model, k) for k in kinds}
    return [Request(prompt=tuple(tok.encode(items[kinds[i % 4]][i // 4 % len(items[kinds[i % 4]])]
                                            ["prompt"])),
                    max_new_tokens=tokens, tau=0.6, lam=0.02, stop_token_ids=stops)
            for i in range(n)]


def closed_loop(decoder, requests, clients: int, policy) -> tuple[int, float]:
    """(tokens committed, seconds) of `requests` sent by `clients` closed-loop clients."""
    from decode.engine.runtime.batcher import Batcher
    b = Batcher(decoder, window_policy=policy)
    done = [0, 0]                                      # finished requests, their tokens

    def finish(f):
        done[0] += 1
        done[1] += len(f.tokens)

    sent = 0
    t0 = time.perf_counter()
    while done[0] < len(requests):
        while sent < len(requests) and sent - done[0] < clients:
            b.submit(requests[sent], on_finish=finish)
            sent += 1
        b.step()
    return done[1], time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decoding.window_ladder",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="verified", choices=("verified", "streaming"))
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--live", default="1,4,16")
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--model", default=DEMO_MODEL)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from benchmarks.decoders import decoder
    from decode.engine.runtime.window_policy import WindowPolicy
    config, params, tok = load_model(args.model)
    live = [int(x) for x in args.live.split(",")]
    requests = make_requests(tok, config, max(live) * args.per_client, args.tokens, args.model)
    capacity = max(len(r.prompt) for r in requests) + args.tokens
    kw = dict(slots=max(live), capacity=capacity, steps_per_call=8, sampling=False,
              page_size=args.page_size)
    dec = decoder(params, config, method=args.method, window=args.window, **kw)
    ar = decoder(params, config, method="ar", window=1, **kw)
    from decode.engine.runtime.batcher import Batcher
    Batcher(dec, window_policy="load").warm_up(capacity)    # every rung, every live-slot bucket
    Batcher(ar).warm_up(capacity)
    runs = {"ar": (ar, lambda: None)}
    runs.update({f"W {w}": (dec, lambda w=w: Fixed(w)) for w in dec.rungs()})
    policy = WindowPolicy(dec.rungs())          # one for the whole run, as a server's
    runs["load"] = (dec, lambda: policy)
    out = dict(command="python -m benchmarks.decoding.window_ladder " + " ".join(argv or []),
               machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
               date=time.strftime("%Y-%m-%d"), method=args.method, window=args.window, results={})
    for c in live:
        reqs = requests[:c * args.per_client]
        rates = {name: [] for name in runs}
        for r in range(args.rounds + 1):                 # round 0 compiles, not counted
            for name, (d, make_policy) in runs.items():
                n, s = closed_loop(d, reqs, c, make_policy())
                if r:
                    rates[name].append(n / s)
        med = {name: statistics.median(v) for name, v in rates.items()}
        fixed = {k: v for k, v in med.items() if k.startswith("W ")}
        best = max(fixed, key=fixed.get)
        out["results"][c] = dict(tokens_per_s=med, best_fixed=best, policy_calls=dict(policy.chosen),
                                 load_over_best=med["load"] / fixed[best],
                                 load_over_ar=med["load"] / med["ar"],
                                 best_over_ar=fixed[best] / med["ar"])
        print(f"live {c:3d}: " + "  ".join(f"{k} {v:7.1f}" for k, v in med.items())
              + f"  | load/best {out['results'][c]['load_over_best']:.2f} ({best})"
              f"  load/AR {out['results'][c]['load_over_ar']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
