"""The demo model's held-out accuracies per regime and method (demo.heldout), unquantized against
quantized weights, side by side.

    python -m benchmarks.quantized.quantize_heldout [--model DIR] [--schemes none,int8,int4] [--items 64]
                                          [--batch 64] [--out FILE]

Each scheme decodes the same held-out items (demo.heldout.evaluate: AR, streaming and verified
streaming at `make demo`'s settings, greedy) with the demo model's weights quantized so
(wedlm_jax.quantize; the static batch decodes quantized weights under their own scheme). Per
regime and method: the quality (accuracy; code: the AR reading's NLL per token, under the
weights decoded with) and its difference from the unquantized run.
"""

from __future__ import annotations

import argparse
import json
import time
from benchmarks import results_file


def run(schemes, items: int, batch: int, model: str) -> dict:
    """{scheme: {regime: {method: summary}}} (demo.heldout.evaluate per scheme) with seconds."""
    from demo.eval import load_model
    from demo.heldout import evaluate
    from wedlm_jax.quantize import quantize_params
    config, params, tok = load_model(model, check=False)
    out = {}
    for scheme in schemes:
        t0 = time.perf_counter()
        results = evaluate(quantize_params(params, scheme), config, tok, model, items, batch)
        out[scheme] = dict(seconds=round(time.perf_counter() - t0, 1), regimes=results)
    return out


def differences(out: dict, base: str = "none") -> dict:
    """{scheme: {regime: {method: quality - the base scheme's}}} (accuracy points x 100; NLL)."""
    if base not in out:
        return {}
    diffs = {}
    for scheme, res in out.items():
        if scheme == base:
            continue
        diffs[scheme] = {}
        for kind, runs in res["regimes"].items():
            ref = out[base]["regimes"][kind]
            diffs[scheme][kind] = {
                m: round(100 * (r["accuracy"] - ref[m]["accuracy"]), 2) if "accuracy" in r
                else round(r["nll"] - ref[m]["nll"], 4)
                for m, r in runs.items() if isinstance(r, dict) and ("accuracy" in r or "nll" in r)}
    return diffs


def main(argv=None) -> dict:
    from demo.eval import DEMO_MODEL
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quantized.quantize_heldout",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEMO_MODEL, help="a demo-shaped model folder (default: "
                                                         "the shipped demo model)")
    ap.add_argument("--schemes", default="none,int8,int4")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None, help="also write the results here (JSON)")
    a = ap.parse_args(argv)
    import jax
    out = run(a.schemes.split(","), a.items, a.batch, a.model)
    report = dict(model=a.model, device=str(jax.devices()[0]), items_per_regime=a.items,
                  batch=a.batch, differences=differences(out), results=out)
    print(json.dumps(report["differences"], indent=1))
    return results_file.write(a.out, report)


if __name__ == "__main__":
    main()
