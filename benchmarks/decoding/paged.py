"""The paged KV cache measured, on the demo model, side by side in one run.

    python -m benchmarks.decoding.paged [--model demo/model] [--rounds 3] [--out benchmarks/results/paged.json]
                             [--only prefix,inflight,step] [--questions 16] [--requests 48]
                             [--few-shot 1000,1900]

  prefix     few-shot workloads (a shared prefix of 1K and of 1.9K tokens, --few-shot: worked examples, then
             a short question each; the demo model's positions end at 2048) and a chat-like one (a shared ~470-token instruction, short questions),
             requests one after another: time to first token (prefill + the steps up to the
             request's first commit: a generate call of up to 8 steps ends there) and tokens/s
             with prefix reuse on and off (same paged Decoder, rounds interleaved, medians);
             and reuse on with every generate call stepping all 4 slots (no live-slot bucket)
  inflight   requests in flight at one fixed cache memory, mixed prompt and output lengths: dense
             slots (each reserves the capacity) against the paged pool (pages mapped as each grows)
  step       one generate call with every slot live: paged against dense, same slots and capacity,
             streaming and AR (this CPU; target: no slowdown beyond 10%)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import jax

from benchmarks.decoders import decoder
from decode.engine.runtime.batcher import Batcher
from decode.engine.step.state import Request
from demo.eval import DEMO_MODEL, eval_items, load_model

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
PAGE = 16


class _Clock:
    """Wall time spent in the Decoder's admission prefill and generate calls (wrapped on the
    instance, for the time-to-first-token breakdown)."""

    def __init__(self, decoder):
        self.spent = {"prefill": 0.0, "generate": 0.0, "generate_calls": 0}
        for name in ("prefill_into_slot", "generate"):
            setattr(decoder, name, self._wrap(getattr(decoder, name), name))
        self.decoder = decoder

    def _wrap(self, fn, name):
        key = "prefill" if name == "prefill_into_slot" else "generate"

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:   # the prefill is dispatched asynchronously: wait for it, to time it apart
                return jax.block_until_ready(fn(*a, **kw)) if key == "prefill" else fn(*a, **kw)
            finally:
                self.spent[key] += time.perf_counter() - t0
                self.spent["generate_calls"] += key == "generate"
        return timed

    def close(self):
        for name in ("prefill_into_slot", "generate"):
            delattr(self.decoder, name)

    def snapshot(self):
        return dict(self.spent)


def _serve(decoder, requests, prefix_reuse=True, buckets=True):
    """The requests one after another (each arrives when the previous one is done, so a time to
    first token is its prefill and the steps to its first commit, not a wait in the queue): the
    median TTFT with its parts (prefill, generate calls, the rest: host work), the wall time,
    tokens/s, and the prompt rows reused. buckets=False: every generate call steps every slot
    (as before `Decoder.live_buckets`), for the side-by-side."""
    b = Batcher(decoder, prefix_reuse=prefix_reuse)
    if not buckets:
        decoder.live_buckets = lambda: []      # on the instance, removed below
    clock = _Clock(decoder)
    ttft, parts, done, t_all = [], [], [], time.perf_counter()
    try:
        for r in requests:
            t0, c0 = time.perf_counter(), clock.snapshot()
            first = []

            def on_tokens(rid, ids, t0=t0, c0=c0, first=first):
                if not first:
                    first.append(time.perf_counter() - t0)
                    c = clock.snapshot()
                    parts.append({k: c[k] - c0[k] for k in c})
            b.submit(r, on_tokens=on_tokens, on_finish=done.append)
            b.run_until_idle()
            ttft.append(first[0])
    finally:
        clock.close()
        vars(decoder).pop("live_buckets", None)
    wall = time.perf_counter() - t_all
    toks = sum(len(f.tokens) for f in done)
    med = lambda k: statistics.median(p[k] for p in parts)
    return dict(ttft_s=statistics.median(ttft), ttft_prefill_s=med("prefill"),
                ttft_generate_s=med("generate"), ttft_generate_calls=med("generate_calls"),
                wall_s=wall, tokens_per_s=toks / wall,
                cached_tokens=sum(f.cached_tokens for f in done),
                prompt_tokens=sum(len(r.prompt) for r in requests))


def prefix_workloads(config, params, tok, rounds: int, model: str = DEMO_MODEL,
                     n_questions: int = 16, few_shot=(1000, 1900)) -> dict:
    items = eval_items(model, "counting") + eval_items(model, "arith")
    shots = "\n\n".join(it["prompt"] + it["target"] for it in items[:40:5])   # worked examples
    few = tok.encode(shots + "\n\n")

    def repeat(ids, n):
        return (ids * (n // len(ids) + 1))[:n]
    system = tok.encode(("You count and add exactly. Answer with the numbers only. " * 12) + "\n")
    questions = [tok.encode(it["prompt"]) for it in items[40:40 + n_questions]]
    out = {}
    workloads = [(f"few-shot {n}", repeat(few, n)) for n in few_shot] + [("chat", system)]
    for name, prefix in workloads:
        reqs = [Request(prompt=tuple(prefix + q), max_new_tokens=16) for q in questions]
        cap = max(len(r.prompt) for r in reqs) + 32
        dec = decoder(params, config, method="streaming", window=8, slots=4, capacity=cap,
                      steps_per_call=8, page_size=PAGE)
        modes = {"on": (True, True), "off": (False, True), "on, every slot": (True, False)}
        for reuse, buckets in modes.values():    # compile
            _serve(dec, reqs[:2], reuse, buckets)
        runs = {m: [] for m in modes}
        for _ in range(rounds):
            for mode, (reuse, buckets) in modes.items():
                runs[mode].append(_serve(dec, reqs, reuse, buckets))
        med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
        med["prefix_tokens"] = len(prefix)
        med["ttft_off_over_on"] = med["off"]["ttft_s"] / med["on"]["ttft_s"]
        med["ttft_off_over_on_every_slot"] = med["off"]["ttft_s"] / med["on, every slot"]["ttft_s"]
        out[name] = med
    return out


def inflight(config, params, rounds: int, n_requests: int = 48) -> dict:
    """Same cache memory (rows x layers x heads): dense 4 slots of capacity 1024; paged 32 slots
    over a pool of 4 x 1024 rows. Mixed lengths: prompts 16-400, outputs 8-96 tokens."""
    rng = random.Random(0)
    reqs = [Request(prompt=tuple(rng.randrange(3, 500) for _ in range(rng.randrange(16, 400))),
                    max_new_tokens=rng.randrange(8, 96)) for _ in range(n_requests)]
    cap = 1024
    dense = decoder(params, config, method="streaming", window=8, slots=4, capacity=cap, steps_per_call=8,
                    page_size=0)
    rows = dense.static.rows
    paged = decoder(params, config, method="streaming", window=8, slots=32, capacity=cap,
                    steps_per_call=8, page_size=PAGE, num_pages=4 * rows // PAGE)
    res = {}
    for name, dec in (("dense", dense), ("paged", paged)):
        b = Batcher(dec, prefix_reuse=False)
        for r in reqs:
            b.submit(r)
        live, t0 = [], time.perf_counter()
        while b.step():
            live.append(b.num_active)
        res[name] = dict(slots=dec.slots, cache_rows=4 * rows, mean_in_flight=statistics.mean(live),
                         max_in_flight=max(live), wall_s=time.perf_counter() - t0)
    res["in_flight_ratio"] = res["paged"]["mean_in_flight"] / res["dense"]["mean_in_flight"]
    return res


def step_time(config, params, rounds: int) -> dict:
    """One generate call of 8 live slots (200-token prompts, capacity 1024): ms per step, paged
    against dense, streaming (W 8) and AR, calls interleaved, medians."""
    reqs = [Request(prompt=tuple(range(3, 3 + 200)), max_new_tokens=400)] * 8
    out = {}
    for method in ("streaming", "ar"):
        kw = dict(method=method, window=8, slots=8, capacity=1024, steps_per_call=8)
        decs = {"dense": decoder(params, config, page_size=0, **kw),
                "paged": decoder(params, config, page_size=PAGE, **kw)}
        states = {}
        for name, dec in decs.items():
            if dec.paged:
                st = dec.init_state()
                for i, r in enumerate(reqs):
                    st = dec.prefill_into_slot(st, r, i, list(range(i * 64, i * 64 + 64)))
            else:
                st = dec.start(reqs)
            st, _ = dec.generate(st)                       # compile
            states[name] = st
        times = {n: [] for n in decs}
        for _ in range(max(3, rounds) * 3):
            for name, dec in decs.items():
                t0 = time.perf_counter()
                states[name], res = dec.generate(states[name])
                times[name].append((time.perf_counter() - t0) / max(res.steps, 1))
        row = {name: dict(ms_per_step=1e3 * statistics.median(times[name])) for name in decs}
        row["paged_over_dense"] = row["paged"]["ms_per_step"] / row["dense"]["ms_per_step"]
        out[method] = row
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decoding.paged", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEMO_MODEL)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="prefix,inflight,step")
    p.add_argument("--questions", type=int, default=16, help="requests of each prefix workload")
    p.add_argument("--requests", type=int, default=48, help="requests of the in-flight workload")
    p.add_argument("--few-shot", default="1000,1900", help="the few-shot workloads' prefix tokens")
    p.add_argument("--out", default=os.path.join(HERE, "results", "paged.json"))
    args = p.parse_args(argv)
    config, params, tok = load_model(args.model)
    t0 = time.time()
    res = {}
    for name in args.only.split(","):
        fn = {"prefix": lambda: prefix_workloads(config, params, tok, args.rounds, args.model,
                                                 args.questions,
                                                 [int(n) for n in args.few_shot.split(",")]),
              "inflight": lambda: inflight(config, params, args.rounds, args.requests),
              "step": lambda: step_time(config, params, args.rounds)}[name]
        res[name] = fn()
        print(name, json.dumps(res[name], indent=1), flush=True)
    meta = dict(command="python -m benchmarks.decoding.paged " + " ".join(argv if argv is not None else sys.argv[1:]),
                machine=f"{platform.machine()}, {os.cpu_count()} CPUs", seconds=round(time.time() - t0, 1),
                page_size=PAGE)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=res), f, indent=1)
    print(args.out)
    return res


if __name__ == "__main__":
    main()
