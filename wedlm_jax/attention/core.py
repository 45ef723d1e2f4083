"""Attention core: grouped-query scaled dot-product attention over an explicit boolean mask,
the masks for the model's three entry points, and the KV-cache write.

Entry points (see `model.Transformer.__call__`):
  (a) causal over physical order, with optional segment ids for packing (`segment_mask`);
  (b) an explicit boolean mask [B, S, T] supplied by the caller (training arrangements);
  (c) cache mode: S new slots per row attend to cache rows `< cache_len[b]` and causally among
      themselves; their K/V are first written at rows `cache_len[b] .. cache_len[b]+S-1`
      (`cache_write`), after which slot i sees the keys `<= cache_last_key(cache_len, S)[b, i]
      = cache_len[b] + i` (`cache_mask` is that rule as a dense mask; every cache-mode kernel in
      `wedlm_jax.attention.cache` reads the same `cache_last_key`).

Scores, softmax and the normaliser are float32 whatever the compute dtype. A query row with no
allowed key (padding) outputs zeros rather than NaN.

Cache mode's implementations (dense reference, live-tile loop, Pallas, cuDNN) live in
`wedlm_jax.attention.cache` and are chosen by `attention.backends.resolve(..., "cache")`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax.attention.kv_quant import to_cache

# The score given to a masked (query, key) pair before the softmax (float32, finite so that a
# running max over masked tiles never produces inf - inf). Shared by every kernel.
NEG_SCORE = float(np.finfo(np.float32).min)


def segment_mask(segment_ids: jnp.ndarray | None, batch: int, length: int) -> jnp.ndarray:
    """Causal mask [B, S, S] over physical order. With `segment_ids` [B, S], a query sees only keys
    of its own segment; segment id 0 marks padding, which attends nowhere and is seen by nobody."""
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))[None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, length, length))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    return causal & same & real


def cache_last_key(cache_len: jnp.ndarray, num_new: int) -> jnp.ndarray:
    """The cache-mode rule, int32 [B, S_new]: new slot i of row b (physical index i of the
    forward, written at cache row cache_len[b] + i) sees cache rows 0 .. cache_len[b] + i."""
    cache_len = jnp.asarray(cache_len, jnp.int32)
    return cache_len[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]


def cache_mask(cache_len: jnp.ndarray, num_new: int, capacity: int) -> jnp.ndarray:
    """`cache_last_key` as a dense mask [B, S_new, capacity]: key t visible iff t <= last."""
    last = cache_last_key(cache_len, num_new)
    return jnp.arange(capacity)[None, None, :] <= last[:, :, None]


def cache_write(buffer: jnp.ndarray, new: jnp.ndarray, cache_len: jnp.ndarray,
                layer) -> jnp.ndarray:
    """Write new[b] ([S, KVH, D]) into the stacked cache buffer [L, B, S_max, KVH, D] at layer
    `layer` (an int32 scalar, traced or not), rows cache_len[b] .. cache_len[b] + S - 1: one
    scatter, which XLA applies to the donated buffer in place (the stacked cache travels whole
    through the layer scan; slicing a layer in and stacking it out would copy the cache, and so
    would a vmap over the batch axis, which moves that axis first). An int8 buffer stores each
    row with its scale (`kv_quant.to_cache`). The caller guarantees cache_len[b] + S <= S_max."""
    b, s = new.shape[:2]
    rows = jnp.asarray(cache_len, jnp.int32)[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]
    batch = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, s))
    return buffer.at[layer, batch, rows].set(to_cache(new, buffer.dtype), indices_are_sorted=True,
                                             unique_indices=True, mode="promise_in_bounds")


def attend(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray,
           scale: float) -> jnp.ndarray:
    """Grouped-query attention.

    q: [B, S, H, D]; k, v: [B, T, KVH, D] with H a multiple of KVH; mask: bool [B, S, T].
    Returns [B, S, H, D] in q's dtype.
    """
    b, s, h, d = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, s, kvh, h // kvh, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) * scale
    allowed = mask[:, None, None, :, :]
    scores = jnp.where(allowed, scores, NEG_SCORE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(allowed, probs, 0.0)
    out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, d).astype(q.dtype)
