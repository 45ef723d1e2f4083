"""Attention core: grouped-query scaled dot-product attention over an explicit boolean mask,
the masks for the model's three entry points, and the KV-cache write.

Entry points (see `model.Transformer.__call__`):
  (a) causal over physical order, with optional segment ids for packing (`segment_mask`);
  (b) an explicit boolean mask [B, S, T] supplied by the caller (training arrangements);
  (c) cache mode: S new slots per row attend to cache rows `< cache_len[b]` and causally among
      themselves; their K/V are first written at rows `cache_len[b] .. cache_len[b]+S-1`
      (`cache_write`), after which the mask is simply `key <= cache_len[b] + i` (`cache_mask`).

Scores, softmax and the normaliser are float32 whatever the compute dtype. A query row with no
allowed key (padding) outputs zeros rather than NaN.

Cache mode has a second implementation, `attend_cache_tiles`: an online softmax over tiles of the
cache whose trip count is dynamic (ceil((max(cache_len) + S) / tile)), so the work follows the
longest committed length in the batch instead of the whole capacity. The model uses it when called
with `kv_tile=`; without it, cache mode keeps the dense `cache_mask` + `attend` path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_mask(segment_ids: jnp.ndarray | None, batch: int, length: int) -> jnp.ndarray:
    """Causal mask [B, S, S] over physical order. With `segment_ids` [B, S], a query sees only keys
    of its own segment; segment id 0 marks padding, which attends nowhere and is seen by nobody."""
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))[None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, length, length))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    return causal & same & real


def cache_mask(cache_len: jnp.ndarray, num_new: int, capacity: int) -> jnp.ndarray:
    """Mask [B, S_new, capacity] for new slot i of row b (written at row cache_len[b] + i):
    every cache row before it and the new slots up to itself, i.e. key <= cache_len[b] + i."""
    last = cache_len[:, None] + jnp.arange(num_new)[None, :]
    return jnp.arange(capacity)[None, None, :] <= last[:, :, None]


def cache_write(buffer: jnp.ndarray, new: jnp.ndarray, cache_len: jnp.ndarray) -> jnp.ndarray:
    """Write new[b] ([S, KVH, D]) into buffer[b] ([S_max, KVH, D]) at row cache_len[b].

    The caller guarantees cache_len[b] + S <= S_max (dynamic_update_slice would otherwise clamp
    the start and overwrite committed rows)."""
    def one(buf, x, start):
        return jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype), (start, 0, 0))
    return jax.vmap(one)(buffer, new, cache_len)


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
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(allowed, probs, 0.0)
    out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, s, h, d).astype(q.dtype)


def attend_cache_tiles(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, cache_len: jnp.ndarray,
                       scale: float, tile: int) -> jnp.ndarray:
    """Cache-mode grouped-query attention that reads only the cache tiles holding live keys.

    q: [B, S, H, D] new slots (already written into the cache at rows cache_len[b] + i);
    k, v: the whole cache [B, T, KVH, D]; slot i of row b sees keys <= cache_len[b] + i (as
    `cache_mask`). Tiles of `tile` rows are visited with an online (running max / sum) softmax;
    the loop runs ceil((max_b cache_len[b] + S) / tile) times, a runtime value. When T is not a
    multiple of the tile, the last tile's start is pulled back to T - tile and rows already
    visited are masked out. Returns [B, S, H, D] in q's dtype; float32 scores and accumulators.
    """
    b, s, h, d = q.shape
    t_max, kvh = k.shape[1], k.shape[2]
    if tile < 1:
        raise ValueError(f"kv_tile must be >= 1, got {tile}")
    tile = min(int(tile), t_max)
    g = h // kvh
    qr = q.reshape(b, s, kvh, g, d)
    last = cache_len[:, None].astype(jnp.int32) + jnp.arange(s, dtype=jnp.int32)[None, :]  # [B, S]
    need = jnp.minimum(jnp.max(cache_len).astype(jnp.int32) + s, t_max)
    n_tiles = (need + tile - 1) // tile
    neg = jnp.finfo(jnp.float32).min

    def body(t, carry):
        m, l, acc = carry
        nominal = t * tile
        start = jnp.minimum(nominal, t_max - tile)
        kt = jax.lax.dynamic_slice_in_dim(k, start, tile, axis=1)
        vt = jax.lax.dynamic_slice_in_dim(v, start, tile, axis=1)
        idx = start + jnp.arange(tile, dtype=jnp.int32)
        allowed = (idx[None, None, :] <= last[:, :, None]) & (idx >= nominal)[None, None, :]
        allowed = allowed[:, None, None, :, :]                                   # [B,1,1,S,tile]
        sc = jnp.einsum("bskgd,btkd->bkgst", qr, kt.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
        sc = jnp.where(allowed, sc, neg)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        p = jnp.where(allowed, jnp.exp(sc - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("bkgst,btkd->bkgsd", p.astype(v.dtype),
                                                 vt.astype(v.dtype), preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((b, kvh, g, s), neg, jnp.float32), jnp.zeros((b, kvh, g, s), jnp.float32),
            jnp.zeros((b, kvh, g, s, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_tiles, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d).astype(q.dtype)
