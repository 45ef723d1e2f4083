"""Flash attention for the training structures on GPU: Pallas (Triton) kernels over a tile plan.

The training layouts (dual stream, the section-4.1 reorder, AR, packed documents) are described
per slot by a structure (`wedlm_jax.masking`: `segment`, `stream`, `block`, `index`), and which
query sees which key is the one rule `masking.pair_mask`. On TPU the splash kernel runs them from
a static template; on GPU the pure-JAX tiled path (`attention.tiled`) runs them as XLA while loops
of small matmuls, one kernel launch per tile pair and a host round trip per loop test. Here the
same tile plan (`tiled.tile_plan`: per query tile its non-empty key tiles, per key tile its
non-empty query tiles) drives three Triton kernels, one launch each per layer:

  forward   grid (B, H, query tiles): each program walks its query tile's live key tiles
            (`kv_index`, `kv_count`), evaluates `pair_mask` on the tile's structure slices and
            keeps an online softmax in float32; writes the output and the log-normaliser
  dK, dV    grid (B, H, key tiles): each program walks its key tile's live query tiles
            (`q_index`, `q_count`), recomputes the probabilities from the log-normaliser
  dQ        grid (B, H, query tiles): the forward's walk, accumulating dQ

Nothing of size [S, T] is ever written; residuals are q, k, v, the output and the
log-normaliser. Grouped-query attention: a program handles one query head against its KV head;
dK and dV come out per query head in float32 and are summed over each KV head's group after.
A query row with no allowed key (padding) outputs 0 and receives no gradient.

Triton's block shapes are powers of two: tiles are powers of two >= 16, the sequences are padded
with padding slots to a power-of-two number of tiles (the padded tiles are empty, so never
computed), and the head dimension with zero columns to a power of two >= 16. `interpret=True`
runs the kernels in Pallas interpret mode on any backend (the CPU tests check them against the
dense reference, values and gradients). `flash_attention` runs them under `jax.shard_map` when a
mesh is set (`sharding.shard_rows`: batch over ('data', 'fsdp'), heads over 'tensor'), since XLA cannot
partition a kernel call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax import sharding
from wedlm_jax.attention import cache as ca
from wedlm_jax.attention import tiled as ta
from wedlm_jax.masking import STRUCTURE_KEYS, pair_mask

TILE = 64               # the kernels' query and key tile (the tile plan's), rows
BWD_WARPS = 8           # the backward kernels hold two [tile, D] float32 accumulators


def kernel_tile(tile: int) -> int:
    """The largest power of two <= `tile` and <= TILE, at least 16 (the Triton lowering's
    smallest block)."""
    return max(16, ca.pow2_at_most(min(int(tile), TILE)))


# --------------------------------------------------------------------------------- kernels

def _struct_at(refs, start, size: int) -> dict:
    """The structure slice [start, start + size) of four refs (STRUCTURE_KEYS order)."""
    from jax.experimental import pallas as pl
    return {name: ref[pl.ds(start, size)] for name, ref in zip(STRUCTURE_KEYS, refs)}


def _scores(q, kt, scale):
    return jax.lax.dot_general(q, kt, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32) * scale


def _fwd_kernel(*refs, scale, tq, tk):
    """One (row b, head h, query tile i) program: its live key tiles into an online softmax."""
    from jax.experimental import pallas as pl
    qs, ks = refs[0:4], refs[4:8]
    idx_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs[8:]
    i = pl.program_id(2)
    q = q_ref[...]
    q_st = _struct_at(qs, i * tq, tq)

    def body(j, carry):
        start = pl.multiple_of(idx_ref[j] * tk, tk)
        ok = pair_mask(q_st, _struct_at(ks, start, tk))
        return ca.kernel_tile(carry, q, k_ref[pl.ds(start, tk), :], v_ref[pl.ds(start, tk), :],
                              ok, scale)

    m, l, acc = jax.lax.fori_loop(0, cnt_ref[i], body, ca.kernel_init(tq, q.shape[-1]))
    o_ref[...] = ca.kernel_result(l, acc, o_ref.dtype)
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), jnp.inf)


def _probs(q, kt, lse, ok, scale):
    """Recomputed probabilities [tq, tk] of a tile pair (0 where the rule forbids)."""
    return jnp.where(ok, jnp.exp(_scores(q, kt, scale) - lse), 0.0)


def _dkv_kernel(*refs, scale, tq, tk):
    """One (row b, head h, key tile c) program: dK, dV of the tile from its live query tiles."""
    from jax.experimental import pallas as pl
    qs, ks = refs[0:4], refs[4:8]
    idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs[8:]
    c = pl.program_id(2)
    kt, vt = k_ref[...], v_ref[...]
    k_st = _struct_at(ks, c * tk, tk)

    def body(j, carry):
        dk, dv = carry
        start = pl.multiple_of(idx_ref[j] * tq, tq)
        rows = pl.ds(start, tq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        p = _probs(q, kt, lse_ref[rows, :], pair_mask(_struct_at(qs, start, tq), k_st), scale)
        dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
        dp = _scores(do, vt, 1.0)
        ds = (p * (dp - delta_ref[rows, :]) * scale).astype(q.dtype)
        dk = dk + jax.lax.dot_general(ds, q, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros(kt.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, cnt_ref[c], body, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk, dv


def _dq_kernel(*refs, scale, tq, tk):
    """One (row b, head h, query tile i) program: dQ of the tile from its live key tiles."""
    from jax.experimental import pallas as pl
    qs, ks = refs[0:4], refs[4:8]
    idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs[8:]
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_st = _struct_at(qs, i * tq, tq)

    def body(j, dq):
        start = pl.multiple_of(idx_ref[j] * tk, tk)
        keys = pl.ds(start, tk)
        kt = k_ref[keys, :]
        p = _probs(q, kt, lse, pair_mask(q_st, _struct_at(ks, start, tk)), scale)
        ds = (p * (_scores(do, v_ref[keys, :], 1.0) - delta) * scale).astype(kt.dtype)
        return dq + jnp.dot(ds, kt, preferred_element_type=jnp.float32)

    dq_ref[...] = jax.lax.fori_loop(0, cnt_ref[i], body,
                                    jnp.zeros(q.shape, jnp.float32)).astype(dq_ref.dtype)


# ------------------------------------------------------------------------------- pallas calls

def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, warps=4):
    from jax.experimental import pallas as pl
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=interpret, name=name,
                          **ca.triton_params(interpret, warps))


def _spec(n: int, d: int, *, head=lambda h: h, tiled: bool = True):
    """Over grid (b, h, t): the [n, d] block of row b, head `head(h)`, at tile t (`tiled`) or
    the whole [n, d] (the walk slices it)."""
    from jax.experimental import pallas as pl
    return pl.BlockSpec((None, None, n, d), lambda b, h, t: (b, head(h), t if tiled else 0, 0))


def _specs(sp: int, tp: int, walk: str, tq: int, tk: int, q_spec, kv_spec):
    """BlockSpecs over grid (b, h, tile): the four query and four key structure rows (whole),
    the walk's index and count (per query tile for "kv", per key tile for "q"), then q's and
    k's, v's specs as given."""
    from jax.experimental import pallas as pl
    row = lambda n: pl.BlockSpec((None, n), lambda b, h, t: (b, 0))
    width = tp // tk if walk == "kv" else sp // tq
    count = sp // tq if walk == "kv" else tp // tk
    return ([row(sp)] * 4 + [row(tp)] * 4
            + [pl.BlockSpec((None, None, width), lambda b, h, t: (b, t, 0)), row(count),
               q_spec, kv_spec, kv_spec])


def _forward(q, k, v, qs, ks, plan, scale, tq, tk, interpret):
    """q [B, H, Sp, D], k/v [B, KVH, Tp, D] -> (out [B, H, Sp, D], lse [B, H, Sp, 1] f32)."""
    b, h, sp, d = q.shape
    tp, group = k.shape[2], h // k.shape[1]
    kernel = functools.partial(_fwd_kernel, scale=scale, tq=tq, tk=tk)
    specs = _specs(sp, tp, "kv", tq, tk, _spec(tq, d),
                   _spec(tp, d, head=lambda h: h // group, tiled=False))
    return _call(kernel, (b, h, sp // tq), specs, [_spec(tq, d), _spec(tq, 1)],
                 [jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((b, h, sp, 1), jnp.float32)], interpret,
                 "wedlm_flash_forward")(*qs, *ks, plan.kv_index, plan.kv_count, q, k, v)


def _backward(q, k, v, o, lse, do, qs, ks, plan, scale, tq, tk, interpret):
    """dq [B, H, Sp, D] (q's dtype), dk, dv [B, KVH, Tp, D] float32."""
    b, h, sp, d = q.shape
    kvh, tp = k.shape[1], k.shape[2]
    group = h // kvh
    kv_head = lambda h: h // group
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    ins = (*qs, *ks)
    # dK, dV: a program per key tile (its K/V tile), walking the whole q, dO, lse, delta
    specs = _specs(sp, tp, "q", tq, tk, _spec(sp, d, tiled=False), _spec(tk, d, head=kv_head))
    specs += [_spec(sp, d, tiled=False), _spec(sp, 1, tiled=False), _spec(sp, 1, tiled=False)]
    per_head = jax.ShapeDtypeStruct((b, h, tp, d), jnp.float32)
    dk, dv = _call(functools.partial(_dkv_kernel, scale=scale, tq=tq, tk=tk), (b, h, tp // tk),
                   specs, [_spec(tk, d)] * 2, [per_head] * 2, interpret, "wedlm_flash_dkv",
                   BWD_WARPS)(*ins, plan.q_index, plan.q_count, q, k, v, do, lse, delta)
    # dQ: a program per query tile (its q, dO, lse, delta tiles), walking the whole K, V
    specs = _specs(sp, tp, "kv", tq, tk, _spec(tq, d), _spec(tp, d, head=kv_head, tiled=False))
    specs += [_spec(tq, d), _spec(tq, 1), _spec(tq, 1)]
    dq = _call(functools.partial(_dq_kernel, scale=scale, tq=tq, tk=tk), (b, h, sp // tq),
               specs, _spec(tq, d), jax.ShapeDtypeStruct(q.shape, q.dtype), interpret,
               "wedlm_flash_dq", BWD_WARPS)(
        *ins, plan.kv_index, plan.kv_count, q, k, v, do, lse, delta)
    group_sum = lambda x: x.reshape(b, kvh, group, tp, d).sum(axis=2)
    return dq, group_sum(dk), group_sum(dv)


# ---------------------------------------------------------------------------- differentiation

@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, qs, ks, plan, scale, tq, tk, interpret):
    return _forward(q, k, v, qs, ks, plan, scale, tq, tk, interpret)[0]


def _flash_fwd(q, k, v, qs, ks, plan, scale, tq, tk, interpret):
    out, lse = _forward(q, k, v, qs, ks, plan, scale, tq, tk, interpret)
    return out, (q, k, v, out, lse, qs, ks, plan)


def _flash_bwd(scale, tq, tk, interpret, res, dout):
    q, k, v, out, lse, qs, ks, plan = res
    dq, dk, dv = _backward(q, k, v, out, lse, dout, qs, ks, plan, scale, tq, tk, interpret)
    no_grad = lambda tree: jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), tree)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), no_grad(qs), no_grad(ks), no_grad(plan)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------- the door

def flash_plan(q_struct, k_struct, tile: int = TILE, batch: int | None = None):
    """(query structure, key structure, tile plan) for the kernels: the structures (arrays
    [B, N]) padded with padding slots to a power-of-two number of `kernel_tile(tile)` tiles, and
    their `tiled.TilePlan`. Compute it once per forward and share it across layers."""
    qs, ks = ta.as_structure(q_struct, batch), ta.as_structure(k_struct, batch)
    t = kernel_tile(tile)
    padded = lambda st: ta.pad_structure(
        st, ca.pow2_at_least(-(-st["segment"].shape[1] // t)) * t)
    qs, ks = padded(qs), padded(ks)
    return qs, ks, ta.tile_plan(qs, ks, t, t)


def flash_attention_local(q, k, v, q_struct, k_struct, plan, scale: float, *,
                          interpret: bool = False) -> jnp.ndarray:
    """`pair_mask` attention of q [B, S, H, D] over k, v [B, T, KVH, D] with the Triton kernels
    on this device's rows, given `flash_plan`'s padded structures and plan: equal to
    `attention.attend(q, k, v, pair_mask(q_struct, k_struct), scale)`, differentiable in q, k, v."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kvh})")
    sp, tp = q_struct["segment"].shape[1], k_struct["segment"].shape[1]
    dp = max(16, ca.pow2_at_least(d))          # zero columns change no score and no output column
    heads = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, dp - d))).transpose(
        0, 2, 1, 3)
    rows = lambda st: tuple(st[name] for name in STRUCTURE_KEYS)
    out = _flash(heads(q, sp), heads(k, tp), heads(v, tp), rows(q_struct), rows(k_struct), plan,
                 float(scale), plan.tile_q, plan.tile_k, bool(interpret))
    return out.transpose(0, 2, 1, 3)[:, :s, :, :d]


def flash_attention(q, k, v, q_struct, k_struct, scale: float, *, tile: int = TILE, plan=None,
                    mesh=None, interpret: bool = False) -> jnp.ndarray:
    """`flash_attention_local` on every device's rows of the current mesh (`sharding.shard_rows`).
    `plan`: `flash_plan`'s (structures, plan) triple for these structures, computed here when
    None."""
    qs, ks, tp = plan if plan is not None else flash_plan(q_struct, k_struct, tile, q.shape[0])
    local = functools.partial(flash_attention_local, scale=scale, interpret=interpret)
    return sharding.shard_rows(local, sharding.current_mesh(mesh), q, k, v, qs, ks, tp)
