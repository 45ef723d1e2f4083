"""Tile-skipping attention in pure JAX: only the (query tile, key tile) pairs the mask allows.

The attention pattern is described per slot by a *structure* (as in `wedlm_jax.masking`): int
arrays `segment` (document, 0 = padding), `stream` (0 memory, 1 prediction), `block` (block index
within the document) and `index` (physical / causal order), each [B, N]. Queries and keys carry
their own structure (queries and keys may differ). Which query sees which key is the one rule
`masking.pair_mask` (imported here as `pair_mask`; `masking.structure_mask` is it with queries and
keys sharing one structure).

Layouts (helpers below build their structures):
    dual-stream (§2)        `dual_stream_structure` / `as_structure(arrangement)`
    section-4.1 reorder      `as_structure` of a "plain" arrangement (prediction, block 0)
    causal + packing         `causal_structure(segment_ids)` (== `attention.segment_mask`)
(Cache-mode decoding is not a structure layout: see `wedlm_jax.attention.cache`.)

Algorithm. Queries and keys are cut into tiles (`tile_q`, `tile_k`; the sequences are padded with
padding slots to a multiple). `tile_plan` evaluates the rule tile by tile (one query tile against
all keys at a time, so memory is O(tile_q * T), never [S, T] per head) and classifies every tile
pair EMPTY / PARTIAL / FULL, exactly: a pair is EMPTY iff no (q, k) in it is allowed. For each
query tile it lists the non-empty key tiles (padded to nk, with a count), and for each key tile the
non-empty query tiles. The forward pass runs sequentially over query tiles (`lax.map`) and, for
each, a `fori_loop` whose trip count is that tile's count (a while loop: the skipped tiles are real
work saved), with an online softmax (running max / normaliser in float32). FULL pairs skip the
per-element mask (`lax.cond`). The backward pass (custom VJP, flash-attention style) recomputes the
probabilities from the saved log-normaliser, running over key tiles with an inner loop over that
key tile's non-empty query tiles: dK, dV accumulate per key tile and dQ is added into its tile.
Residuals are q, k, v, the output and the log-normaliser: memory linear in the sequence length.

Batch: rows are `jax.vmap`ped, so under vmap each query tile's loop runs the largest count among
the rows (extra iterations are masked out by the batched while loop); rows with the same
arrangement shape (e.g. the dual stream of equal-length rows) have nearly equal counts. With a
batch sharded over devices, each device runs its own rows.

Grouped-query attention: q [B, S, H, D], k/v [B, T, KVH, D], H a multiple of KVH; the query
heads of one KV head are processed together against that head's keys.

A query row with no allowed key (padding) outputs 0 and receives zero gradient, like
`attention.attend`. Scores, softmax and accumulators are float32 whatever the input dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax import masking
from wedlm_jax.attention.core import NEG_SCORE
# the rule and its constants are defined once, in masking
from wedlm_jax.masking import MEMORY, PREDICTION, STRUCTURE_KEYS, pair_mask  # noqa: F401

EMPTY, PARTIAL, FULL = 0, 1, 2
_NEG = NEG_SCORE


# ------------------------------------------------------------------------------- structures

def as_structure(structure, batch: int | None = None) -> dict:
    """The four structure arrays of `structure` (any mapping holding them, e.g. an arrangement)
    as int32 [B, N]. A single row [N] gets a leading batch dim (broadcast to `batch` if given)."""
    missing = [k for k in STRUCTURE_KEYS if k not in structure]
    if missing:
        raise ValueError(f"a structure needs the int arrays {STRUCTURE_KEYS}; missing {missing}")
    out = {k: jnp.asarray(structure[k], jnp.int32) for k in STRUCTURE_KEYS}
    shapes = {a.shape for a in out.values()}
    if len(shapes) != 1:
        raise ValueError(f"structure arrays must share one shape; got {sorted(shapes)}")
    if out["segment"].ndim == 1:
        out = {k: a[None] for k, a in out.items()}
    if out["segment"].ndim != 2:
        raise ValueError(f"structure arrays must be [N] or [B, N]; got {out['segment'].shape}")
    if batch is not None and out["segment"].shape[0] != batch:
        out = {k: jnp.broadcast_to(a, (batch, a.shape[1])) for k, a in out.items()}
    return out


def dual_stream_structure(segment_ids, block_size: int) -> dict:
    """Structure of the dual-stream arrangement of rows `segment_ids` [B, L] -> [B, 2L]
    (see `masking.dual_stream_structure`; independent of the masking draw)."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    if seg.ndim == 1:
        seg = seg[None]
    return jax.vmap(lambda s: masking.dual_stream_structure(s, block_size))(seg)


def causal_structure(segment_ids, batch: int, length: int) -> dict:
    """Causal attention over physical order, within segments when `segment_ids` [B, S] is given
    (segment 0 = padding attends nowhere): the structure of `attention.segment_mask`."""
    if segment_ids is None:
        seg = jnp.ones((batch, length), jnp.int32)
    else:
        seg = jnp.asarray(segment_ids, jnp.int32)
    zeros = jnp.zeros((batch, length), jnp.int32)
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return {"segment": seg, "stream": zeros, "block": zeros, "index": index}


# ------------------------------------------------------------------------------------- plan

def tile_sizes(num_q: int, num_k: int, tile_q: int, tile_k: int) -> tuple[int, int]:
    """The tile sizes actually used: at most the (unpadded) lengths."""
    if tile_q < 1 or tile_k < 1:
        raise ValueError(f"tile sizes must be >= 1; got tile_q={tile_q}, tile_k={tile_k}")
    return min(int(tile_q), num_q), min(int(tile_k), num_k)


def _pad_to(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def pad_structure(s: dict, n: int) -> dict:
    """Structure arrays [B, N] padded with padding slots (segment 0) to [B, n]."""
    cur = s["segment"].shape[1]
    if cur == n:
        return s
    return {k: jnp.pad(a, ((0, 0), (0, n - cur))) for k, a in s.items()}   # segment 0 = padding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Which tile pairs to compute, for structures padded to tile multiples.

    state     int8  [B, nq, nk]  EMPTY (0) / PARTIAL (1) / FULL (2) per (query tile, key tile)
    kv_index  int32 [B, nq, nk]  per query tile: its non-empty key tiles first (ascending)
    kv_count  int32 [B, nq]      how many of them
    q_index   int32 [B, nk, nq]  per key tile: its non-empty query tiles first (ascending)
    q_count   int32 [B, nk]
    """
    state: jnp.ndarray
    kv_index: jnp.ndarray
    kv_count: jnp.ndarray
    q_index: jnp.ndarray
    q_count: jnp.ndarray
    tile_q: int = dataclasses.field(metadata=dict(static=True))
    tile_k: int = dataclasses.field(metadata=dict(static=True))


def tile_occupancy(q_struct, k_struct, tile_q: int, tile_k: int) -> jnp.ndarray:
    """int8 [B, nq, nk]: EMPTY / PARTIAL / FULL of every (query tile, key tile) pair, exact,
    evaluated one query tile at a time (memory O(B * tile_q * T)). Tiles are the ones
    `tiled_attention` uses for these lengths (see `tile_sizes`; tails padded with padding slots)."""
    qs, ks = as_structure(q_struct), as_structure(k_struct)
    b = max(qs["segment"].shape[0], ks["segment"].shape[0])
    qs, ks = as_structure(qs, b), as_structure(ks, b)
    tq, tk = tile_sizes(qs["segment"].shape[1], ks["segment"].shape[1], tile_q, tile_k)
    sp, tp = _pad_to(qs["segment"].shape[1], tq), _pad_to(ks["segment"].shape[1], tk)
    qs, ks = pad_structure(qs, sp), pad_structure(ks, tp)
    nq, nk = sp // tq, tp // tk
    q_tiles = {k: a.reshape(b, nq, tq).transpose(1, 0, 2) for k, a in qs.items()}

    def one(qt):
        allowed = pair_mask(qt, ks).reshape(b, tq, nk, tk)               # [B, tq, nk, tk]
        any_ = jnp.any(allowed, axis=(1, 3))
        all_ = jnp.all(allowed, axis=(1, 3))
        return jnp.where(all_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int8)

    return jax.lax.map(one, q_tiles).transpose(1, 0, 2)


def _compact(active):
    """Indices of the True entries first (ascending), then the rest; and their count."""
    order = jnp.argsort(jnp.logical_not(active), axis=-1, stable=True).astype(jnp.int32)
    return order, jnp.sum(active, axis=-1, dtype=jnp.int32)


def tile_plan(q_struct, k_struct, tile_q: int = 128, tile_k: int = 128) -> TilePlan:
    """The `TilePlan` of these structures; compute it once and share it across layers."""
    qs, ks = as_structure(q_struct), as_structure(k_struct)
    tq, tk = tile_sizes(qs["segment"].shape[1], ks["segment"].shape[1], tile_q, tile_k)
    state = tile_occupancy(qs, ks, tq, tk)
    active = state != EMPTY
    kv_index, kv_count = _compact(active)
    q_index, q_count = _compact(jnp.swapaxes(active, 1, 2))
    return TilePlan(state, kv_index, kv_count, q_index, q_count, tq, tk)


def plan_counts(plan_or_state) -> dict:
    """Numbers of tile pairs (summed over the batch): total, empty (skipped), partial, full."""
    state = plan_or_state.state if isinstance(plan_or_state, TilePlan) else plan_or_state
    state = jnp.asarray(state)
    return {"total": int(state.size),
            "empty": int(jnp.sum(state == EMPTY)),
            "partial": int(jnp.sum(state == PARTIAL)),
            "full": int(jnp.sum(state == FULL))}


# --------------------------------------------------------------------------------- kernels
# One batch row. Layouts inside: queries as tiles [nq, KVH, G, tq, D], keys [KVH, Tp, D].

def _slice_struct(ks: dict, start, size: int) -> dict:
    return {k: jax.lax.dynamic_slice_in_dim(a, start, size) for k, a in ks.items()}


def _index_struct(s: dict, i) -> dict:
    return {k: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for k, a in s.items()}


def _fwd_row(q, k, v, qs, ks, state, kv_index, kv_count, *, scale, tq, tk):
    """q [nq, KVH, G, tq, D]; k, v [KVH, Tp, D]; qs dict of [nq, tq]; ks dict of [Tp]."""
    kvh, g, d = q.shape[1], q.shape[2], q.shape[4]

    def one_q_tile(x):
        qi, qsi, state_i, idx_i, count_i = x

        def body(n, carry):
            m, l, acc = carry
            j = idx_i[n]
            start = j * tk
            kj = jax.lax.dynamic_slice_in_dim(k, start, tk, axis=1)
            vj = jax.lax.dynamic_slice_in_dim(v, start, tk, axis=1)
            s = jnp.einsum("hgqd,htd->hgqt", qi, kj, preferred_element_type=jnp.float32) * scale

            def full(s):
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                return m_new, jnp.exp(s - m_new[..., None])

            def partial(s):
                allowed = pair_mask(qsi, _slice_struct(ks, start, tk))          # [tq, tk]
                s = jnp.where(allowed, s, _NEG)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                return m_new, jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)

            m_new, p = jax.lax.cond(state_i[j] == FULL, full, partial, s)
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=-1)
            acc = acc * corr[..., None] + jnp.einsum(
                "hgqt,htd->hgqd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l, acc

        init = (jnp.full((kvh, g, tq), _NEG, jnp.float32), jnp.zeros((kvh, g, tq), jnp.float32),
                jnp.zeros((kvh, g, tq, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, count_i, body, init)
        ok = l > 0
        out = jnp.where(ok[..., None], acc / jnp.where(ok, l, 1.0)[..., None], 0.0)
        lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), jnp.inf)
        return out.astype(q.dtype), lse

    return jax.lax.map(one_q_tile, (q, qs, state, kv_index, kv_count))


def _bwd_row(q, k, v, o, lse, do, qs, ks, state, q_index, q_count, *, scale, tq, tk):
    """Tile layouts as `_fwd_row`; o, do like q; lse [nq, KVH, G, tq]. Returns dq (tile layout,
    f32), dk, dv [nk, KVH, tk, D] (f32)."""
    kvh, d = q.shape[1], q.shape[4]
    nk = k.shape[1] // tk
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)   # [nq, KVH, G, tq]
    k_tiles = k.reshape(kvh, nk, tk, d).transpose(1, 0, 2, 3)                   # [nk, KVH, tk, D]
    v_tiles = v.reshape(kvh, nk, tk, d).transpose(1, 0, 2, 3)
    ks_tiles = {name: a.reshape(nk, tk) for name, a in ks.items()}
    state_t = state.T                                                            # [nk, nq]

    def one_k_tile(dq, x):
        kj, vj, ksj, state_j, idx_j, count_j = x

        def body(n, carry):
            dq, dk, dv = carry
            i = idx_j[n]
            qi = jax.lax.dynamic_index_in_dim(q, i, 0, keepdims=False)
            doi = jax.lax.dynamic_index_in_dim(do, i, 0, keepdims=False)
            lse_i = jax.lax.dynamic_index_in_dim(lse, i, 0, keepdims=False)
            delta_i = jax.lax.dynamic_index_in_dim(delta, i, 0, keepdims=False)
            s = jnp.einsum("hgqd,htd->hgqt", qi, kj, preferred_element_type=jnp.float32) * scale

            def full(s):
                return jnp.exp(s - lse_i[..., None])

            def partial(s):
                allowed = pair_mask(_index_struct(qs, i), ksj)
                return jnp.where(allowed, jnp.exp(jnp.where(allowed, s, 0.0) - lse_i[..., None]),
                                 0.0)

            p = jax.lax.cond(state_j[i] == FULL, full, partial, s)
            dv = dv + jnp.einsum("hgqt,hgqd->htd", p.astype(do.dtype), doi,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("hgqd,htd->hgqt", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None])
            dk = dk + jnp.einsum("hgqt,hgqd->htd", ds.astype(q.dtype), qi,
                                 preferred_element_type=jnp.float32) * scale
            dqi = jnp.einsum("hgqt,htd->hgqd", ds.astype(k.dtype), kj,
                             preferred_element_type=jnp.float32) * scale
            cur = jax.lax.dynamic_index_in_dim(dq, i, 0, keepdims=False)
            dq = jax.lax.dynamic_update_index_in_dim(dq, cur + dqi, i, 0)
            return dq, dk, dv

        zeros = jnp.zeros((kvh, tk, d), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, count_j, body, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq0 = jnp.zeros(q.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(one_k_tile, dq0,
                                (k_tiles, v_tiles, ks_tiles, state_t, q_index, q_count))
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom VJP

def _layouts(q, k, v, kvh, tq):
    b, sp, h, d = q.shape
    g = h // kvh
    qt = q.reshape(b, sp // tq, tq, kvh, g, d).transpose(0, 1, 3, 4, 2, 5)
    kt = k.transpose(0, 2, 1, 3)                                                 # [B, KVH, Tp, D]
    vt = v.transpose(0, 2, 1, 3)
    return qt, kt, vt


def _from_tiles(x):
    """[B, nq, KVH, G, tq, D] -> [B, Sp, H, D]."""
    b, nq, kvh, g, tq, d = x.shape
    return x.transpose(0, 1, 4, 2, 3, 5).reshape(b, nq * tq, kvh * g, d)


def _tile_struct(qs, tq):
    return {k: a.reshape(a.shape[0], a.shape[1] // tq, tq) for k, a in qs.items()}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _tiled_core(q, k, v, qs, ks, plan_arrays, scale, tq, tk):
    out, _ = _tiled_fwd(q, k, v, qs, ks, plan_arrays, scale, tq, tk)
    return out


def _tiled_fwd(q, k, v, qs, ks, plan_arrays, scale, tq, tk):
    state, kv_index, kv_count, _, _ = plan_arrays
    qt, kt, vt = _layouts(q, k, v, k.shape[2], tq)
    fwd = functools.partial(_fwd_row, scale=scale, tq=tq, tk=tk)
    ot, lse = jax.vmap(fwd)(qt, kt, vt, _tile_struct(qs, tq), ks, state, kv_index, kv_count)
    return _from_tiles(ot), (q, k, v, ot, lse, qs, ks, plan_arrays)


def _tiled_bwd(scale, tq, tk, res, dout):
    q, k, v, ot, lse, qs, ks, plan_arrays = res
    state, _, _, q_index, q_count = plan_arrays
    kvh = k.shape[2]
    qt, kt, vt = _layouts(q, k, v, kvh, tq)
    dot = _layouts(dout, k, v, kvh, tq)[0]
    bwd = functools.partial(_bwd_row, scale=scale, tq=tq, tk=tk)
    dqt, dk, dv = jax.vmap(bwd)(qt, kt, vt, ot, lse, dot, _tile_struct(qs, tq), ks, state,
                                q_index, q_count)
    b, t, _, d = k.shape
    to_keys = lambda x: x.transpose(0, 1, 3, 2, 4).reshape(b, t, kvh, d)       # [B,nk,KVH,tk,D]
    zeros_like_int = lambda tree: jax.tree.map(
        lambda a: np.zeros(a.shape, jax.dtypes.float0), tree)
    return (_from_tiles(dqt).astype(q.dtype), to_keys(dk).astype(k.dtype),
            to_keys(dv).astype(v.dtype), zeros_like_int(qs), zeros_like_int(ks),
            zeros_like_int(plan_arrays))


_tiled_core.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_attention(q, k, v, q_struct, k_struct, scale: float, *, tile_q: int = 128,
                    tile_k: int = 128, plan: TilePlan | None = None) -> jnp.ndarray:
    """Masked grouped-query attention computing only the non-empty tile pairs.

    q [B, S, H, D]; k, v [B, T, KVH, D]; `q_struct` / `k_struct` structures with arrays [B, S] /
    [B, T] (or [S] / [T], broadcast over the batch). `plan` (from `tile_plan` on the same
    structures and tile sizes) is computed here when not given. Returns [B, S, H, D] in q's
    dtype, equal to `attention.attend(q, k, v, pair_mask(q_struct, k_struct), scale)`.
    Differentiable in q, k, v (custom VJP, memory linear in S + T)."""
    b, s, h, d = q.shape
    t, kvh = k.shape[1], k.shape[2]
    if k.shape != (b, t, kvh, d) or v.shape != k.shape:
        raise ValueError(f"k and v must be [B, T, KVH, D] matching q {q.shape}; got {k.shape}, "
                         f"{v.shape}")
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kvh})")
    qs, ks = as_structure(q_struct, b), as_structure(k_struct, b)
    if qs["segment"].shape[1] != s or ks["segment"].shape[1] != t:
        raise ValueError(f"structures [B, {qs['segment'].shape[1]}] / [B, "
                         f"{ks['segment'].shape[1]}] do not match S={s}, T={t}")
    if plan is None:
        plan = tile_plan(qs, ks, tile_q, tile_k)
    tq, tk = plan.tile_q, plan.tile_k
    sp, tp = _pad_to(s, tq), _pad_to(t, tk)
    if plan.state.shape != (b, sp // tq, tp // tk):
        raise ValueError(f"plan of shape {plan.state.shape} does not fit B={b}, S={s}, T={t} "
                         f"with tiles ({tq}, {tk})")
    qs, ks = pad_structure(qs, sp), pad_structure(ks, tp)
    if sp != s:
        q = jnp.pad(q, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    if tp != t:
        k = jnp.pad(k, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    arrays = (plan.state, plan.kv_index, plan.kv_count, plan.q_index, plan.q_count)
    out = _tiled_core(q, k, v, qs, ks, arrays, float(scale), tq, tk)
    return out[:, :s]
