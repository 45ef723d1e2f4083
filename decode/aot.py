"""The Decoder's programs compiled ahead of time from abstract shapes: no weights, no cache, no
device of the target needed (forced CPU devices, or a TPU topology jax describes with libtpu).

    compile_generate(config, device, method=..., window=..., slots=..., capacity=..., dtype=...)
        -> dict: XLA memory_analysis (bytes per device) and cost_analysis (flops, bytes accessed,
           libtpu's optimal_seconds where the compiler gives it) of one `generate` call of one
           step, and the analytic floor of that step (`step_floor`)

`cost_analysis` counts a loop body once: the `generate` call of k = 1 step is one pass of the
decode loop's body, i.e. one decoding step (its layer scan counted once too, so flops and bytes
are scaled by the layers here: `per_step`).
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
    weights = model_lib_params(c) * item
    kv_row = 2 * c.num_layers * c.num_kv_heads * c.head_dim * item
    kv = static.slots * live_rows * kv_row
    new = static.slots * static.span * kv_row
    logits = static.slots * static.span * c.vocab_size * 4
    return dict(weights=weights, kv_read=kv, kv_written=new, logits=logits,
                total=weights + kv + new + logits)


def model_lib_params(c) -> int:
    return int(c.num_params())


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) and x else x


def compile_generate(config, device, *, method="streaming", window=16, refill="before", slots=8,
                     capacity=4096, dtype="bfloat16", attention="tiled", kv_tile=256) -> dict:
    """Compile `generate` (k = 1) of a Decoder of these settings for `device`'s platform and
    return its figures (see the module docstring)."""
    from decode.decoder import Decoder, _generate
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
    layers = config.num_layers
    out = dict(platform=device.platform, method=method, window=dec.window, refill=refill,
               slots=slots, capacity=capacity, rows=dec.static.rows, dtype=jnp.dtype(dtype).name,
               attention=attention, memory=mem,
               cache_bytes=2 * slots * dec.static.rows * layers * config.num_kv_heads
               * config.head_dim * jnp.dtype(dtype).itemsize)
    if cost:
        out["cost"] = {k: float(v) for k, v in cost.items()
                       if k in ("flops", "bytes accessed", "optimal_seconds", "transcendentals")}
    return out
