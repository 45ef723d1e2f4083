"""Cost of one decoding forward by window size: why W must be picked from a measurement on CPU.

On an accelerator a forward of a few slots is memory-bound and W slots cost about what 1 does;
on this CPU a small model is compute-bound and the forward grows with W. This times the
cache-mode forward of W slots (the engine's tiled cache attention, logits consumed) on top of a
committed prefix as the decode loop runs it (many forwards in one jitted loop over a donated
cache), for W = 1 (an AR step) and the window sizes of streaming decoding, interleaved so a change
of load hits every W alike.

    python -m benchmarks.window_cost [--config configs/demo_pretrain.yaml] [--prefix 128] [--repeats 50]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main(argv=None) -> int:
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

    from synthetic import random_params
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
    return 0


def measure(config, params, windows, prefix=128, capacity=512, kv_tile=256, repeats=50,
            inner=16, *, batch=1, attention="tiled", dtype=None, interpret=False) -> dict:
    """Median seconds of one cache-mode forward of W slots on `prefix` committed tokens, for each W
    in `windows`, timed as the decode loop runs it: `inner` forwards in one jitted `fori_loop` that
    carries the (donated) cache and consumes the logits, so neither the per-call dispatch nor a copy
    of the cache is counted. Interleaved over W, so a change of load hits every W alike.
    `batch` rows at once; `attention` the cache-mode implementation (see
    `attention_backends.resolve`), `kv_tile` its KV tile; `dtype` the compute and cache dtype
    (default float32); `interpret` runs accelerator kernels in their CPU-checkable form."""
    import jax
    import jax.numpy as jnp

    from wedlm_jax.model import Transformer, init_kv_cache
    dtype = jnp.float32 if dtype is None else dtype
    model = Transformer(config, dtype=dtype, attention=attention, kv_tile=kv_tile,
                        attention_interpret=interpret)
    rows = capacity + max(windows)

    def loop(params, tokens, positions, cache, n):
        def body(_, carry):
            cache, acc = carry
            logits, cache = model.apply({"params": params}, tokens, positions, kv_cache=cache,
                                        cache_len=n)
            return cache, acc + jnp.sum(jnp.argmax(logits, -1))
        return jax.lax.fori_loop(0, inner, body, (cache, jnp.zeros((), jnp.int32)))

    loop = jax.jit(loop, donate_argnums=(3,))
    n = jnp.full((batch,), prefix, jnp.int32)
    rng = np.random.default_rng(0)
    inputs = {}
    cache = init_kv_cache(config, batch, rows, dtype)
    for w in windows:
        toks = jnp.asarray(rng.integers(0, config.vocab_size, (batch, w)), jnp.int32)
        pos = prefix + jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32)[None], (batch, w))
        inputs[w] = (toks, pos)
        cache, acc = loop(params, toks, pos, cache, n)                # compile
        acc.block_until_ready()
    times = {w: [] for w in windows}
    for _ in range(repeats):
        for w in windows:
            t0 = time.perf_counter()
            cache, acc = loop(params, *inputs[w], cache, n)
            acc.block_until_ready()
            times[w].append((time.perf_counter() - t0) / inner)
    return {w: float(np.median(t)) for w, t in times.items()}


if __name__ == "__main__":
    raise SystemExit(main())
