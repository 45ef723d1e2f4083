"""`make demo`: the shipped WeDLM demo model (demo/model, trained here: see its README.md)
decodes held-out counting, arithmetic, record and code prompts with streaming parallel decoding,
then the same prompts are decoded by streaming, verified streaming (output = AR greedy's), block
and AR decoding on the same weights, side by side.

    python -m demo [--items N] [--repeats R] [--window W] [--tau T] [--lam L] [--model DIR]

Prints each regime's first continuation (streaming) and a table: tokens per forward, p_cache,
tokens/s, wall-clock ratio over AR, and the regime's quality (counting exact, arithmetic accuracy,
records exact, code: the AR-reading NLL per token of the continuation); then this machine's ceiling
at the chosen W, measured in the same run: W tokens per forward over the cost of a forward of the
slots it holds, in AR steps (decode/compile/cost.py). On an accelerator that cost is about 1. A missing or damaged model file is named
before anything is loaded, with how to restore or rebuild it.
"""

from __future__ import annotations

import argparse
import sys

from decode.compile.cost import ceiling
from demo.eval import (DEMO_MODEL, DemoModelError, REGIMES, check_model, decode_side_by_side,
                       quality)

# The demo's decoding defaults, picked from the measurements in BENCHMARKS.md.
WINDOW, TAU, LAM = 8, 0.6, 0.02
METHODS = ("streaming", "verified", "block", "ar")
REGIME_ORDER = ("counting", "arith", "records", "code")


def quality_text(kind, params, config, res) -> str:
    q = quality(params, config, kind, res)
    return f"NLL {q:.3f}" if kind == "code" else f"{100 * q:.0f}% right"


def main(argv=None) -> int:
    from wedlm_jax.runtime import platforms
    platforms.choose()      # no backend whose hardware is absent (a libtpu lock, a CUDA error)
    ap = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEMO_MODEL)
    ap.add_argument("--items", type=int, default=4, help="held-out prompts per regime (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per method; median (default 3)")
    ap.add_argument("--window", type=int, default=WINDOW)
    ap.add_argument("--tau", type=float, default=TAU)
    ap.add_argument("--lam", type=float, default=LAM)
    args = ap.parse_args(argv)
    try:
        check_model(args.model)
    except DemoModelError as e:
        print(f"make demo: {e}", file=sys.stderr)
        return 2

    from decode.config import DecodeConfig
    from demo.eval import eval_items, load_model
    config, params, tok = load_model(args.model, check=False)
    print(f"wedlm-jax demo: {args.model}\n  {config.model_type}, {config.num_params():,} parameters, "
          f"{config.num_layers} layers, vocab {config.vocab_size}; trained on this project's own data "
          f"(see its README.md)\n  streaming decoding: W={args.window}, tau={args.tau}, "
          f"lambda={args.lam}, greedy, one prompt per call\n")
    table = []
    for kind in REGIME_ORDER:
        items = eval_items(args.model, kind, args.items)
        dcs = {m: DecodeConfig(method=m, window=args.window, tau=args.tau, lam=args.lam,
                               max_new_tokens=REGIMES[kind].max_new_tokens) for m in METHODS}
        # same prompts, same weights, same cache code; the methods take turns (side by side)
        runs = decode_side_by_side(params, config, tok, items, kind, dcs, repeats=args.repeats)
        first = runs["streaming"]["rows"][0]
        print(f"[{kind}] {first['prompt']!r}\n  streaming -> {first['text']!r}\n"
              f"  verified  -> {runs['verified']['rows'][0]['text']!r}  (= AR greedy's)\n")
        for m in METHODS:
            r = runs[m]
            table.append((kind, m, r["n_gen"], r["steps"], r["tokens_per_forward"], r["p_cache"],
                          r["tokens_per_s"], r["tokens_per_s"] / runs["ar"]["tokens_per_s"],
                          quality_text(kind, params, config, r)))
    print(f"{args.items} held-out prompts per regime, batch 1, methods in turn, median wall time of "
          f"{args.repeats} rounds (compile excluded), float32 on {_device()}:")
    head = ("regime", "method", "tokens", "forwards", "tok/fwd", "p_cache", "tok/s", "vs AR", "quality")
    print(f"{head[0]:<10}{head[1]:<11}{head[2]:>7}{head[3]:>9}{head[4]:>9}{head[5]:>9}{head[6]:>8}"
          f"{head[7]:>8}  {head[8]}")
    for kind, m, n, steps, tpf, pc, tps, ratio, q in table:
        print(f"{kind:<10}{m:<11}{n:>7}{steps:>9}{tpf:>9.2f}{pc:>9.3f}{tps:>8.0f}{ratio:>7.2f}x  {q}")
    cost = forward_costs(params, config, args.window)
    slots = max(cost)
    ceil = ceiling(args.window, "before", cost)
    print(f"\nthis machine's ceiling at W={args.window}: {args.window} tokens per forward, a forward of "
          f"{slots} slots costs {cost[slots] / cost[1]:.2f} AR steps ({1e3 * cost[slots]:.2f} vs "
          f"{1e3 * cost[1]:.2f} ms) -> at most {ceil:.2f}x AR")
    for kind in REGIME_ORDER:
        r = next(t for t in table if t[0] == kind and t[1] == "streaming")
        print(f"  {kind:<9} streaming {r[7]:.2f}x AR = {100 * r[7] / ceil:.0f}% of the ceiling; "
              f"{r[4]:.2f} tokens per forward = {100 * r[4] / args.window:.0f}% of the cap {args.window}")
    from demo.structured import print_records_with_schema
    print_records_with_schema(params, config, tok, eval_items(args.model, "records", args.items),
                              DecodeConfig(window=args.window, tau=args.tau, lam=args.lam,
                                           max_new_tokens=192))
    print("\ntok/fwd = tokens per forward; p_cache = tokens emitted / token slots computed; "
          "vs AR = this method's tokens/s over AR's (the wall-clock ratio for equal output).\nBENCHMARKS.md has the sweeps: "
          "python -m benchmarks.demo_model.demo_experiments all")
    return 0


def forward_costs(params, config, window: int) -> dict:
    """{slots: seconds} of one cache-mode forward of 1 slot (an AR step) and of the slots a window
    step holds (2W with the shipped refill 'before'), timed interleaved as the decode loop runs it."""
    from decode.compile.cost import forward_seconds, forward_slots
    return forward_seconds(config, params, [1, forward_slots(window, "before")], prefix=128,
                           capacity=512, repeats=15)


def _device() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform} ({jax.device_count()} device{'s' if jax.device_count() > 1 else ''})"


if __name__ == "__main__":
    sys.exit(main())
