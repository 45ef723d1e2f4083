"""The Decoder's programs compiled ahead of time from abstract shapes: no weights, no cache, no
device of the target needed (forced CPU devices, or a TPU topology jax describes with libtpu).

    compile_generate(config, device, method=..., window=..., slots=..., capacity=..., dtype=...,
                     live_rows=...)
        -> dict: XLA memory_analysis (bytes per device) and cost_analysis (flops, bytes accessed,
           libtpu's optimal_seconds where the compiler gives it) of one `generate` call of one
           step, the cache's size, and the analytic floor of that step (`step_floor`)

`cost_analysis` counts a loop body once: the `generate` call of k = 1 step is one pass of the
decode loop's body, i.e. one decoding step, but its layer scan is counted once too, so its flops
and bytes are one layer plus the rest of the step (not scaled here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax import model as model_lib


def _on(device, tree):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                        tree)


def abstract_args(decoder, device):
    """(params, state, mask_id, run) of `decoder`'s `generate` as ShapeDtypeStructs on `device`."""
    st = decoder.static
    host = decoder._host_free()
    layers = jax.eval_shape(lambda: model_lib.init_kv_cache(st.config, st.slots, st.rows,
                                                            jnp.dtype(st.dtype)))
    state = host.replace(cache=host.cache.replace(layers=layers))
    params = model_lib.param_shapes(decoder.model_config, jnp.dtype(st.dtype))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return _on(device, params), _on(device, state), _on(device, scalar), _on(device, scalar)


def step_floor(static, live_rows: int) -> dict:
    """The bytes one decoding step cannot avoid moving: every weight once, the live K/V of every
    slot (`live_rows` committed rows) once, the step's own K/V rows written, the logits written."""
    c, item = static.config, jnp.dtype(static.dtype).itemsize
    weights = c.num_params() * item
    kv_row = 2 * c.num_layers * c.num_kv_heads * c.head_dim * item
    kv = static.slots * live_rows * kv_row
    new = static.slots * static.span * kv_row
    logits = static.slots * static.span * c.vocab_size * 4
    return dict(weights=weights, kv_read=kv, kv_written=new, logits=logits,
                total=weights + kv + new + logits)


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) and x else x


def compile_generate(config, device, *, method="streaming", window=16, refill="before", slots=8,
                     capacity=4096, dtype="bfloat16", attention="tiled", kv_tile=256,
                     live_rows: int | None = None) -> dict:
    """Compile `generate` (k = 1) of a Decoder of these settings for `device`'s platform and
    return its figures (see the module docstring); `live_rows` (committed rows per slot) adds the
    step's floor."""
    from decode.decoder import Decoder, _generate, estimate_memory
    params = model_lib.param_shapes(config, jnp.dtype(dtype))
    dec = Decoder(params, config, method=method, window=window, refill=refill, slots=slots,
                  capacity=capacity, steps_per_call=1, dtype=jnp.dtype(dtype), attention=attention,
                  kv_tile=kv_tile, sampling=False, mask_token_id=config.vocab_size - 1,
                  memory_limit_bytes=1 << 62, allow_long=True)
    p, s, mask_id, run = abstract_args(dec, device)
    lowered = _generate.lower(dec.static, 1, p, s, mask_id, run)
    compiled = lowered.compile()
    m = compiled.memory_analysis()
    mem = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "alias", "temp", "generated_code")}
    cost = _first(compiled.cost_analysis()) or {}
    out = dict(platform=device.platform, method=method, window=dec.window, refill=refill,
               slots=slots, capacity=capacity, rows=dec.static.rows, dtype=jnp.dtype(dtype).name,
               attention=attention, memory=mem, cache_bytes=estimate_memory(dec.static)["cache"])
    if live_rows is not None:
        out["floor"] = step_floor(dec.static, live_rows)
    if cost:
        out["cost"] = {k: float(v) for k, v in cost.items()
                       if k in ("flops", "bytes accessed", "optimal_seconds", "transcendentals")}
    return out
