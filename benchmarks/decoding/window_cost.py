"""Cost of one decoding forward by window size: why W must be picked from a measurement on CPU.

On an accelerator a forward of a few slots is memory-bound and W slots cost about what 1 does;
on this CPU a small model is compute-bound and the forward grows with W. This times the
cache-mode forward of W slots (the engine's tiled cache attention, logits consumed) on top of a
committed prefix as the decode loop runs it (many forwards in one jitted loop over a donated
cache), for W = 1 (an AR step) and the window sizes of streaming decoding, interleaved so a change
of load hits every W alike.

    python -m benchmarks.decoding.window_cost [--config configs/demo_pretrain.yaml] [--prefix 128] [--repeats 50]
"""

from __future__ import annotations

import argparse
import json
import os

from decode.compile.cost import forward_seconds as measure  # noqa: F401  (the benchmarks' name)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo_pretrain.yaml",
                   help="a wedlm-train config whose model.config gives the shape")
    p.add_argument("--windows", default="1,4,8,16,32")
    p.add_argument("--prefix", type=int, default=128, help="committed tokens in the cache")
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--kv-tile", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)

    import jax

    from benchmarks.synthetic import random_params
    from train.config import load_config, model_config

    config = model_config(load_config(a.config))
    params = random_params(config, seed=0)
    windows = [int(w) for w in a.windows.split(",")]
    times = measure(config, params, windows, a.prefix, a.capacity, a.kv_tile, a.repeats)
    base = times[windows[0]]
    print(json.dumps({"machine": f"{os.uname().machine}, {os.cpu_count()} CPUs, jax "
                      f"{jax.__version__} on {jax.default_backend()}",
                      "loadavg": os.getloadavg(), "config": a.config,
                      "params": config.num_params(), "prefix": a.prefix}))
    print(f"{'W':>4} {'median ms':>10} {'x W=' + str(windows[0]):>8} {'ms per slot':>12}")
    for w in windows:
        med = times[w]
        print(f"{w:>4} {med * 1e3:>10.2f} {med / base:>8.2f} {med * 1e3 / w:>12.3f}")
    return times


if __name__ == "__main__":
    main()
