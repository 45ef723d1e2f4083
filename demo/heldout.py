"""The demo model judged on its held-out prompts, every regime and method side by side, batched.

    python -m demo.heldout --model DIR [--eval FILE] [--items N] [--batch B] --out FILE.json

For each regime (counting, arithmetic, lists, records, code) the first N held-out items of
eval.jsonl (fresh numbers: never in training, demo/data.py) are decoded greedy by AR, streaming
and verified streaming at `make demo`'s settings (demo.run: window, tau, lambda), B rows per call.
Per regime and method: accuracy (code: the AR reading's NLL per token of the continuation),
tokens per forward, p_cache; and whether verified gave AR's tokens on every item (it must: its
commits are AR-verified). Then streaming again at stricter (tau, lambda) pairs (SWEEP: runtime
knobs of the same compiled program, no compile), accuracy and tokens per forward per regime: how
close to AR streaming comes at what speed, to choose `make demo`'s defaults from. Written as JSON;
a line per regime and method printed, then the sweep.

This is the pipeline's last stage (demo/pipeline.py), run where the model was trained; `make demo`
(demo/run.py) is the same comparison timed one prompt at a time on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

KINDS = ("counting", "arith", "lists", "records", "code")
CAPACITY = 512          # cache rows per slot: the longest prompt and its budget fit
METHODS = ("ar", "streaming", "verified")
SWEEP = ((0.3, 0.05), (0.2, 0.05), (0.3, 0.1))     # streaming's (tau, lambda) beyond the defaults


def evaluate(params, config, tok, eval_path: str, items: int, batch: int) -> dict:
    """{regime: {method: summary}} over the first `items` held-out items of each regime."""
    from decode.config import DecodeConfig
    from decode.static.static_batch import static_decoder
    from demo.eval import REGIMES, decode_items, eval_items
    from demo.run import LAM, TAU, WINDOW
    out = {}
    regimes = {kind: eval_items(eval_path, kind, items) for kind in KINDS}
    # one Decoder per method for every regime (`batch` slots, the longest budget) and every
    # prompt padded to the longest one's bucket: one prefill and one step program per method
    longest = max(len(tok.encode(it["prompt"])) for its in regimes.values() for it in its)
    budget = max(REGIMES[kind].max_new_tokens for kind in KINDS)
    decoders = {m: static_decoder(params, config, batch, DecodeConfig(method=m, window=WINDOW),
                                  CAPACITY, budget) for m in METHODS}
    for kind, its in regimes.items():
        runs = {}
        for m in METHODS:
            dc = DecodeConfig(method=m, window=WINDOW, tau=TAU, lam=LAM,
                              max_new_tokens=REGIMES[kind].max_new_tokens)
            runs[m] = decode_items(params, config, tok, its, kind, dc, batch=batch, warmup=False,
                                   capacity=CAPACITY, prompt_bucket=longest, decoder=decoders[m])
        same = [a["ids"] == v["ids"] for a, v in zip(runs["ar"]["rows"], runs["verified"]["rows"])]
        out[kind] = {m: summary(kind, params, config, r) for m, r in runs.items()}
        out[kind]["verified_equals_ar"] = f"{sum(same)}/{len(same)}"
        out[kind]["first"] = {m: runs[m]["rows"][0]["text"] for m in METHODS}
        out[kind]["streaming_sweep"] = {
            f"tau={tau},lam={lam}": summary(kind, params, config, decode_items(
                params, config, tok, its, kind,
                DecodeConfig(method="streaming", window=WINDOW, tau=tau, lam=lam,
                             max_new_tokens=REGIMES[kind].max_new_tokens),
                batch=batch, warmup=False, capacity=CAPACITY, prompt_bucket=longest,
                decoder=decoders["streaming"]))
            for tau, lam in SWEEP}
    return out


def summary(kind: str, params, config, result: dict) -> dict:
    from demo.eval import quality
    q = quality(params, config, kind, result)
    return {"items": result["n_items"], ("nll" if kind == "code" else "accuracy"): q,
            "tokens": result["n_gen"], "forwards": result["steps"],
            "tokens_per_forward": result["tokens_per_forward"], "p_cache": result["p_cache"],
            "wall_s": result["wall_s"]}


def table(results: dict) -> str:
    lines = [f"{'regime':<10}{'method':<11}{'quality':>10}{'tok/fwd':>9}{'p_cache':>9}"]
    for kind, runs in results.items():
        for m in METHODS:
            r = runs[m]
            q = _quality(r)
            lines.append(f"{kind:<10}{m:<11}{q:>10}{r['tokens_per_forward']:>9.2f}{r['p_cache']:>9.3f}")
        lines.append(f"{'':<10}verified = AR on {runs['verified_equals_ar']} items")
    lines.append("streaming at stricter settings (quality, tokens / forward):")
    for kind, runs in results.items():
        cells = [f"{name} {_quality(r)} {r['tokens_per_forward']:.2f}"
                 for name, r in runs["streaming_sweep"].items()]
        lines.append(f"{kind:<10}" + "; ".join(cells))
    return "\n".join(lines)


def _quality(r: dict) -> str:
    return f"{r['nll']:.3f} nll" if "nll" in r else f"{100 * r['accuracy']:.1f}%"


def main(argv=None) -> int:
    from wedlm_jax.runtime import platforms
    platforms.choose()      # no backend whose hardware is absent (a libtpu lock, a CUDA error)
    p = argparse.ArgumentParser(prog="python -m demo.heldout", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (HF layout, with tokenizer)")
    p.add_argument("--eval", default=None, help="eval.jsonl (default: the model folder's)")
    p.add_argument("--items", type=int, default=64, help="held-out items per regime (default 64)")
    p.add_argument("--batch", type=int, default=64, help="rows per decode call (default 64)")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args(argv)
    eval_path = a.eval or os.path.join(a.model, "eval.jsonl")
    if not os.path.isfile(eval_path):
        print(f"demo.heldout: {eval_path}: no such file (demo.data writes eval.jsonl)", file=sys.stderr)
        return 2
    if a.items < 1 or a.batch < 1:
        print(f"demo.heldout: --items and --batch must be >= 1, got {a.items} and {a.batch}",
              file=sys.stderr)
        return 2
    from demo.eval import load_model
    t0 = time.perf_counter()
    config, params, tok = load_model(a.model, check=False)
    results = evaluate(params, config, tok, eval_path, a.items, a.batch)
    import jax
    report = {"model": os.path.abspath(a.model), "device": str(jax.devices()[0].device_kind),
              "items_per_regime": a.items, "batch": a.batch, "seconds": time.perf_counter() - t0,
              "regimes": results}
    tmp = a.out + ".partial"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, a.out)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
