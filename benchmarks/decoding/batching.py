"""Continuous vs static batching on the demo model.

    python -m benchmarks.decoding.batching [--requests 128] [--slots 8] [--repeats 3] [--out FILE.json]

The same requests (held-out demo prompts of mixed lengths, max_new_tokens drawn from 8-256, no stop
ids so every request runs its whole budget) through the same number of slots, two ways:
  static      groups of `slots` requests in arrival order, each group run by `generate()` on one
              Decoder until its slowest row ends (the rows that finished early idle);
  continuous  `decode.engine.runtime.batcher.Batcher` on one Decoder: a request takes a slot the moment one
              frees;
  paged       the same continuous batching on a Decoder with the paged KV cache (`--page-size`
              rows a page, pages mapped as each sequence grows): every admission a
              prefill into pages, every call ending at a new request's first tokens.
For streaming and AR. Both are compiled before timing; rounds alternate static / continuous and
the median wall time is kept. Prints and saves tokens/s and the ratio continuous / static.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import time

import numpy as np

from demo.eval import DEMO_MODEL, eval_items, load_model

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def make_requests(tokenizer, n: int, seed: int = 0, model: str = DEMO_MODEL):
    from decode.engine.step.state import Request
    rng = random.Random(seed)
    prompts = []
    for kind in ("counting", "arith", "code"):
        prompts += [tokenizer.encode(it["prompt"]) for it in eval_items(model, kind)]
    return [Request(prompt=tuple(rng.choice(prompts)), max_new_tokens=rng.randint(8, 256),
                    tau=0.6, lam=0.02) for _ in range(n)]


def run_static(decoder, requests):
    """Groups of `slots` requests in arrival order; a group ends when its slowest row ends."""
    n = 0
    t0 = time.perf_counter()
    for i in range(0, len(requests), decoder.slots):
        state = decoder.init_state()
        for slot, r in enumerate(requests[i:i + decoder.slots]):
            state = decoder.insert(decoder.prefill(r), state, slot)
        done = False
        while not done:
            state, res = decoder.generate(state)
            n += int(res.counts.sum())
            done = bool(np.all(res.done))
    return n, time.perf_counter() - t0


def run_continuous(decoder, requests):
    from decode.engine.runtime.batcher import Batcher
    b = Batcher(decoder)
    count = [0]
    for r in requests:
        b.submit(r, on_finish=lambda f: count.__setitem__(0, count[0] + len(f.tokens)))
    t0 = time.perf_counter()
    b.run_until_idle()
    return count[0], time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decoding.batching", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16, help="the paged mode's page (0: no "
                                                                 "paged mode)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "batching.json"))
    ap.add_argument("--model", default=DEMO_MODEL, help="a demo-shaped model folder (default: the "
                                                         "shipped one)")
    args = ap.parse_args(argv)
    from benchmarks.decoders import decoder
    config, params, tok = load_model(args.model)
    requests = make_requests(tok, args.requests, model=args.model)
    capacity = max(len(r.prompt) + r.max_new_tokens for r in requests)
    out = dict(command=f"python -m benchmarks.decoding.batching --requests {args.requests} --slots {args.slots} "
                       f"--repeats {args.repeats} --window {args.window} --page-size {args.page_size}",
               machine=f"{platform.machine()}, {os.cpu_count()} CPUs", loadavg=os.getloadavg(),
               results={})
    for method in ("streaming", "ar"):
        kw = dict(method=method, window=args.window, slots=args.slots, capacity=capacity,
                  steps_per_call=16, sampling=False)
        dec = decoder(params, config, page_size=0, **kw)
        modes = {"static": (run_static, dec), "continuous": (run_continuous, dec)}
        if args.page_size:
            modes["paged"] = (run_continuous, decoder(params, config, page_size=args.page_size, **kw))
        # compile every program and prompt bucket first, the small ones too: a paged admission
        # that reuses a cached prefix prefills only the rest of its prompt
        top = max(dec.prompt_bucket(len(r.prompt)) for r in requests)
        base = list(requests[0].prompt)
        warm = [dataclasses.replace(requests[0], prompt=tuple((base * n)[:n]), max_new_tokens=8)
                for n in (1 << i for i in range(4, top.bit_length()))]
        for run, d in modes.values():
            run(d, warm if run is run_continuous else warm[:args.slots])
        walls = {m: [] for m in modes}
        tokens = {}
        for _ in range(args.repeats):
            for mode, (run, d) in modes.items():
                tokens[mode], w = run(d, requests)
                walls[mode].append(w)
        row = {}
        for mode in walls:
            wall = statistics.median(walls[mode])
            row[mode] = dict(tokens=tokens[mode], wall_s=wall, walls=walls[mode],
                             tokens_per_s=tokens[mode] / wall)
        row["ratio"] = row["continuous"]["tokens_per_s"] / row["static"]["tokens_per_s"]
        paged = ""
        if "paged" in row:
            row["paged_over_dense"] = row["paged"]["tokens_per_s"] / row["continuous"]["tokens_per_s"]
            paged = (f"   paged {row['paged']['tokens_per_s']:7.0f} tok/s ({row['paged_over_dense']:.2f}x "
                     f"the dense continuous)")
        out["results"][method] = row
        print(f"{method:<10} static {row['static']['tokens_per_s']:7.0f} tok/s   continuous "
              f"{row['continuous']['tokens_per_s']:7.0f} tok/s   continuous / static {row['ratio']:.2f}x"
              f"{paged}   ({tokens['continuous']} tokens, {args.requests} requests, {args.slots} slots)",
              flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
