"""Milliseconds per decode step of one Decoder, every slot live: the figure to compare two checkouts
by (run it in each, alternately, and take medians).

    python -m benchmarks.decoding.step_time [--model demo/model] [--slots 8] [--window 8] [--chunks 12]

Streaming (W, refill before) and AR on the same weights: `slots` requests inserted with long
budgets (counting prompts), one compile chunk, then `chunks` timed `generate` calls of 8 steps;
prints {"streaming": ms, "ar": ms} (medians over chunks). Before/after a change, e.g.:

    git worktree add /tmp/before HEAD~1
    for r in 1 2 3; do for t in /tmp/before .; do (cd $t && PYTHONPATH=$t python -m benchmarks.decoding.step_time); done; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decoding.step_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=12)
    a = ap.parse_args(argv)
    import jax
    from benchmarks.decoders import decoder
    from decode.engine.step.state import Request
    from demo.eval import DEMO_MODEL, load_model
    config, params, tok = load_model(a.model or DEMO_MODEL)
    out = {}
    for method in ("streaming", "ar"):
        dec = decoder(params, config, method=method, window=a.window, slots=a.slots, capacity=512,
                      steps_per_call=8, sampling=False, page_size=0)
        st = dec.init_state()
        for b in range(a.slots):
            prompt = tuple(tok.encode(f"Count by {b + 2} from {100 * b + 7} to 9000:\n"))
            st = dec.insert(dec.prefill(Request(prompt=prompt, max_new_tokens=400, tau=0.0)), st, b)
        st, _ = dec.generate(st)            # the compile
        times = []
        for _ in range(a.chunks):
            t0 = time.perf_counter()
            st, res = dec.generate(st)
            jax.block_until_ready(st.done)
            times.append((time.perf_counter() - t0) / max(res.steps, 1) * 1e3)
        out[method] = round(statistics.median(times), 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
