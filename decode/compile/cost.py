"""What one decoding forward costs by the number of slots it holds, and the speed-up over AR it
allows: the ceiling every measured ratio is read against (`make demo` prints both, measured in the
same run; `benchmarks/decoding/window_cost.py` prints the table).

On an accelerator a forward of a few slots is memory-bound and S slots cost about what 1 does; on
a CPU a small model is compute-bound and the forward grows with S, so a method that emits up to W
tokens per forward of S slots is capped at W * t(1) / t(S) times AR's tokens per second.
"""

from __future__ import annotations

import time

import numpy as np

from wedlm_jax.attention.table import TILED


def ceiling(window: int, refill: str, seconds: dict) -> float:
    """The most a window method can gain over AR in tokens/s: W tokens per forward (the cap, with
    refill 'before'; W/2 with 'after') over the cost of its forward of S slots (2W with 'before',
    W with 'after') in AR steps. `seconds`: {slots: seconds per forward}, holding 1 and S."""
    cap = window if refill == "before" else window / 2
    return cap * seconds[1] / seconds[forward_slots(window, refill)]


def forward_slots(window: int, refill: str) -> int:
    """Slots one forward holds at window W (what `ceiling` needs timed besides 1)."""
    from decode.engine.step.steps import StepSpec
    return StepSpec(method="streaming", window=window, refill=refill).span


def forward_seconds(config, params, windows, prefix=128, capacity=512, kv_tile=256, repeats=50,
            inner=16, *, batch=1, attention=TILED, dtype=None, interpret=False) -> dict:
    """Median seconds of one cache-mode forward of W slots on `prefix` committed tokens, for each W
    in `windows`, timed as the decode loop runs it: `inner` forwards in one jitted `fori_loop` that
    carries the (donated) cache and consumes the logits, so neither the per-call dispatch nor a copy
    of the cache is counted. Interleaved over W, so a change of load hits every W alike.
    `batch` rows at once; `attention` the cache-mode implementation (see
    `attention.backends.resolve`), `kv_tile` its KV tile; `dtype` the compute and cache dtype
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
