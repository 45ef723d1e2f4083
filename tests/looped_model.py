"""The decoder as a Python loop over layers (how `model.Transformer` ran before the layer scan),
for tests only: the scanned model must equal it. It reuses the library's `Block` and norms, and
takes the stacked params, slicing layer i out of every `layers` parameter."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from wedlm_jax import model as model_lib
from wedlm_jax.rope import rope_cos_sin, rope_frequencies


def looped_apply(config, params, tokens, positions, *, dtype=jnp.float32, mask=None,
                 segment_ids=None, kv_cache=None, cache_len=None, kv_tile=256):
    """Logits (and the new stacked cache in cache mode) of a layer-by-layer Python loop."""
    c = config
    dense = model_lib.Transformer(c, dtype=dtype, attention="dense", kv_tile=kv_tile)
    mask = model_lib.attention_input(dense, tokens.shape, segment_ids=segment_ids, mask=mask,
                                     kv_cache=kv_cache, cache_len=cache_len)
    x = jnp.take(params["embedding"], tokens, axis=0).astype(dtype)
    inv_freq, scaling = rope_frequencies(c)
    cos, sin = rope_cos_sin(positions, inv_freq, scaling)
    block = model_lib.Block(c, dtype, jnp.float32)
    cache = kv_cache
    for i in range(c.num_layers):
        layer = jax.tree.map(lambda p: p[i], params["layers"])
        (x, cache, _), _ = block.apply({"params": layer}, (x, cache, jnp.int32(i)), cos, sin, mask,
                                       cache_len)
    norm = model_lib.RMSNorm(c.rms_norm_eps, "norm", jnp.float32)
    x = norm.apply({"params": params["final_norm"]}, x)
    head = params["embedding"].T if c.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum("bse,ev->bsv", x, head.astype(dtype), preferred_element_type=jnp.float32)
    if kv_cache is None:
        return logits
    return logits, cache
