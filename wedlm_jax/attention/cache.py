"""Cache-mode attention: the S new slots of a decoding forward against the KV cache.

One rule (`attention.cache_last_key`): the query at physical index i of the forward (its K/V
already written at cache row cache_len[b] + i by `attention.cache_write`) sees cache rows
0 .. cache_len[b] + i. Every implementation below computes exactly that, with float32 scores and
softmax, and returns [B, S, H, D] in q's dtype:

    dense   `attention.attend` over `attention.cache_mask` [B, S, capacity]: the reference; reads
            the whole capacity.
    tiled   `attend_cache_tiles`: an online softmax over tiles of `tile` cache rows whose trip
            count is a runtime value, ceil((max_b cache_len[b] + S) / tile): it reads the tiles up
            to the longest live row of the batch, not the capacity (pure JAX, any platform).
    pallas  `attend_cache_pallas`: a Pallas kernel, one program per (row, KV head, block of
            QUERY_BLOCK query rows, split), whose loop runs over that row's own live tiles up to
            its block's last query, ceil((cache_len[b] + last slot + 1) / tile) (ragged: a short
            row stops early); a small grid cuts each program's tiles into splits (`auto_splits`,
            flash-decoding). The cache is read in place in its [B, T, KVH, D] layout. GPU
            (Triton lowering); anywhere with `interpret=True` (how CPU tests check it).
    cudnn   `attend_cache_cudnn`: cuDNN flash attention through `jax.nn.dot_product_attention`
            with per-row key lengths (cache_len + S: the rows past them are padding to cuDNN) and
            the in-window causality as a [B, 1, S, T] boolean mask. GPU, bf16/fp16; the same
            argument set runs through `implementation='xla'` anywhere (how CPU tests check it).

`attend_cache(impl, ...)` dispatches; `attention.backends.resolve(name, "cache")` picks `impl`
for the platform (and names the available ones when asked for one the platform lacks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax.attention import kv_quant
from wedlm_jax.attention.core import NEG_SCORE, attend, cache_last_key, cache_mask
from wedlm_jax.attention.table import BACKENDS, CUDNN, DENSE, PALLAS, TILED
from wedlm_jax.buckets import pow2_at_least
from wedlm_jax.attention.table import CACHE_IMPLEMENTATIONS as IMPLEMENTATIONS


def _check(q, k, v, cache_len):
    b, s, h, d = q.shape
    if k.ndim != 4 or k.shape[0] != b or k.shape[3] != d or v.shape != k.shape:
        raise ValueError(f"k and v must be the cache [B, T, KVH, D] matching q {q.shape}; got "
                         f"{k.shape}, {v.shape}")
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({k.shape[2]})")
    if jnp.shape(cache_len) != (b,):
        raise ValueError(f"cache_len must be [B] = [{b}]; got shape {jnp.shape(cache_len)}")
    if s > k.shape[1]:
        raise ValueError(f"{s} new slots do not fit a cache of {k.shape[1]} rows")


def check_int_at_least(name: str, value, low: int) -> int:
    """`value` when it is an int >= `low`; a ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def check_tile(tile) -> int:
    return check_int_at_least("kv_tile", tile, 1)


# ------------------------------------------------------------------------------------- dense

def attend_cache_dense(q, k, v, cache_len, scale: float):
    """The reference: `attend` over the dense cache mask (reads every row of the capacity)."""
    _check(q, k, v, cache_len)
    return attend(q, k, v, cache_mask(cache_len, q.shape[1], k.shape[1]), scale)


# ------------------------------------------------------------------------------------- tiled

def attend_cache_tiles(q, k, v, cache_len, scale: float, tile: int, layer=None):
    """Cache-mode attention reading only the cache tiles that hold live keys of some row.

    Tiles of `tile` rows are visited with an online (running max / sum) softmax; the loop runs
    ceil((max_b cache_len[b] + S) / tile) times, a runtime value. When T is not a multiple of the
    tile, the last tile's start is pulled back to T - tile and rows already visited are masked.
    With `layer`, k and v are the stacked cache [L, B, T, KVH, D] and each tile is read straight
    from that layer of it (no copy of the layer is made)."""
    view = lambda x: kv_quant.float_view(x if layer is None else
                                         jax.ShapeDtypeStruct(x.shape[1:], x.dtype), q.dtype)
    _check(q, view(k), view(v), cache_len)                       # one layer: [B, T, KVH, D]
    layer_shape = view(k).shape
    b, s, h, d = q.shape
    t_max, kvh = layer_shape[1], layer_shape[2]
    tile = min(check_tile(tile), t_max)

    def read(buf, start):
        """One tile [B, tile, KVH, D] of the cache (of its layer `layer` when stacked), an int8
        cache's dequantized."""
        if layer is None:
            part = jax.lax.dynamic_slice_in_dim(buf, start, tile, axis=1)
        else:
            part = jax.lax.dynamic_slice(buf, (layer, 0, start, 0, 0),
                                         (1, b, tile, kvh, buf.shape[-1]))[0]
        return kv_quant.from_cache(part, q.dtype)

    g = h // kvh
    qr = q.reshape(b, s, kvh, g, d)
    last = cache_last_key(cache_len, s)                                          # [B, S]
    need = jnp.minimum(jnp.max(last) + 1, t_max)
    n_tiles = (need + tile - 1) // tile

    def body(t, carry):
        nominal = t * tile
        start = jnp.minimum(nominal, t_max - tile)
        kt, vt = read(k, start), read(v, start)
        idx = start + jnp.arange(tile, dtype=jnp.int32)
        allowed = (idx[None, None, :] <= last[:, :, None]) & (idx >= nominal)[None, None, :]
        allowed = allowed[:, None, None, :, :]                                   # [B,1,1,S,tile]
        return online_softmax_step(carry, qr, kt, vt, allowed, scale)

    _, l, acc = jax.lax.fori_loop(0, n_tiles, body, online_softmax_init(b, kvh, g, s, d))
    return online_softmax_result(l, acc, q)


def online_softmax_init(b, kvh, g, s, d):
    """The running (max, sum, weighted values) of an online softmax over key tiles, empty."""
    return (jnp.full((b, kvh, g, s), NEG_SCORE, jnp.float32), jnp.zeros((b, kvh, g, s), jnp.float32),
            jnp.zeros((b, kvh, g, s, d), jnp.float32))


def online_softmax_step(carry, qr, kt, vt, allowed, scale):
    """One key tile into the running softmax: qr [B, S, KVH, G, D], kt / vt [B, tile, KVH, D],
    allowed [B, 1, 1, S, tile] (float32 scores and sums whatever the inputs' dtype)."""
    m, l, acc = carry
    sc = jnp.einsum("bskgd,btkd->bkgst", qr, kt.astype(qr.dtype),
                    preferred_element_type=jnp.float32) * scale
    sc = jnp.where(allowed, sc, NEG_SCORE)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
    p = jnp.where(allowed, jnp.exp(sc - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1)
    acc = acc * corr[..., None] + jnp.einsum(
        "bkgst,btkd->bkgsd", p.astype(vt.dtype), vt, preferred_element_type=jnp.float32)
    return m_new, l, acc


def online_softmax_result(l, acc, q):
    """[B, S, H, D] in q's dtype (0 for a query that saw no key)."""
    b, s, h, d = q.shape
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d).astype(q.dtype)


# ------------------------------------------------------------------------------------ pallas

def pow2_at_most(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


# Shared memory a Triton program may use, by CUDA compute capability (the vendor's "maximum shared
# memory per block, opt-in"); unknown devices get the smallest
SMEM_BYTES = {"9.0": 232448, "10.0": 232448, "12.0": 101376, "8.0": 166912, "8.7": 166912,
              "8.6": 101376, "8.9": 101376}
PALLAS_STAGES = 2   # the Triton pipeline depth the kernel is compiled with (num_stages)
# query rows per program of the Triton kernels (a prefill chunk's S x G rows are cut into blocks
# of this many, one program each)
QUERY_BLOCK = 64
# programs a Triton kernel's grid should reach (about two per streaming multiprocessor of an
# H100's 132): fewer (a small batch) and each program's live tiles are cut into splits
TARGET_PROGRAMS = 256


def auto_splits(programs: int, tiles: int) -> int:
    """Splits of each program's KV tiles (a power of two) for a grid of `programs` programs over
    `tiles` tiles at most a row: doubled while the grid is under TARGET_PROGRAMS and every split
    keeps a tile at full capacity. One when the grid is already full."""
    splits = 1
    while programs * splits < TARGET_PROGRAMS and 2 * splits <= tiles:
        splits *= 2
    return splits


def query_rows(rows: int) -> int:
    """The query rows one program holds: `rows` (S x G) padded as `query_block` pads them, at most
    QUERY_BLOCK."""
    return min(max(16, pow2_at_least(rows)), QUERY_BLOCK)


def smem_limit(device=None) -> int:
    """Shared-memory bytes per block of `device` (a CUDA device, or a compile-only one from a
    described topology); the smallest known figure when its compute capability is unknown."""
    cc = str(getattr(device, "compute_capability", "") or "")
    return SMEM_BYTES.get(cc, min(SMEM_BYTES.values()))


def pallas_smem(tile: int, rows: int, head_dim: int, itemsize: int) -> int:
    """Shared memory the Triton cache kernel needs: the K and V tiles of every pipeline stage and
    one program's query rows (`query_rows` of the forward's `rows` = S x G)."""
    return PALLAS_STAGES * 2 * tile * head_dim * itemsize + query_rows(rows) * head_dim * itemsize


def pallas_tile(tile: int, rows: int, head_dim: int, itemsize: int, limit: int) -> int:
    """The largest power-of-two KV tile <= `tile` whose kernel fits `limit` bytes of shared
    memory (at least 16); raises ValueError when even 16 does not fit."""
    t = pow2_at_most(check_tile(tile))
    while t > 16 and pallas_smem(t, rows, head_dim, itemsize) > limit:
        t //= 2
    if pallas_smem(t, rows, head_dim, itemsize) > limit:
        raise ValueError(f"the Pallas cache kernel needs {pallas_smem(t, rows, head_dim, itemsize)} "
                         f"bytes of shared memory for {rows} query rows of head_dim {head_dim} even "
                         f"at a 16-row KV tile, more than the device's {limit}; use attention "
                         "'tiled'")
    return t


def _pallas_kernel(len_ref, q_ref, k_ref, v_ref, *out_refs, scale, tile, groups, width, capacity,
                   splits):
    """One (row b, KV head, query block k x split p) program. q_ref [Rb, D]: rows k * Rb.. of the
    row's S x G query heads of this KV head (`query_block`: row r = slot r // G); k_ref / v_ref
    [T, D]: the cache of this row and head, read tile by tile up to the block's last query (split
    p of `splits` takes its share of those tiles); len_ref [1]: cache_len[b]. out_refs: the
    output, or with splits the partials (`kernel_store`)."""
    from jax.experimental import pallas as pl
    n, c = len_ref[0], pl.program_id(2)
    k, rb = c // splits, q_ref.shape[0]
    q = q_ref[...]
    slot = (k * rb + jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)) // groups
    last = n + jnp.minimum(slot, width - 1)                                      # [Rb, 1]
    top = n + jnp.minimum((k * rb + rb - 1) // groups, width - 1)                # the block's last
    n_tiles = (jnp.minimum(top + 1, capacity) + tile - 1) // tile

    def body(i, carry):
        nominal = i * tile
        start = jnp.minimum(nominal, capacity - tile)
        col = start + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)
        return kernel_tile(carry, q, k_ref[pl.ds(start, tile), :], v_ref[pl.ds(start, tile), :],
                           (col <= last) & (col >= nominal), scale)

    lo, hi = split_range(n_tiles, c % splits, splits)
    kernel_store(out_refs, jax.lax.fori_loop(lo, hi, body, kernel_init(rb, q_ref.shape[1])))


def split_range(n, p, splits: int):
    """Split p's share [lo, hi) of n loop iterations cut into `splits` consecutive parts."""
    per = (n + splits - 1) // splits
    lo = jnp.minimum(p * per, n)
    return lo, jnp.minimum(lo + per, n)


def kernel_store(out_refs, carry) -> None:
    """A program's online softmax written out: one ref, the normalised output; three (a split
    kernel), the float32 accumulator, max and sum for `combine_splits`."""
    m, l, acc = carry
    if len(out_refs) == 1:
        out_refs[0][...] = kernel_result(l, acc, out_refs[0].dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def split_outputs(b: int, kvh: int, blocks: int, rows: int, d: int, dtype, splits: int):
    """(out_shape, out_specs) of a kernel over grid (B, KVH, blocks x splits): the output
    [B, KVH, blocks x rows, D] in `dtype`, or with splits > 1 the partials [B, KVH, splits,
    blocks x rows, D | 1] in float32."""
    from jax.experimental import pallas as pl
    if splits == 1:
        return (jax.ShapeDtypeStruct((b, kvh, blocks * rows, d), dtype),
                pl.BlockSpec((None, None, rows, d), lambda i, j, c: (i, j, c, 0)))
    spec = lambda w: pl.BlockSpec((None, None, None, rows, w),
                                  lambda i, j, c: (i, j, c % splits, c // splits, 0))
    shape = lambda w: jax.ShapeDtypeStruct((b, kvh, splits, blocks * rows, w), jnp.float32)
    return (shape(d), shape(1), shape(1)), (spec(d), spec(1), spec(1))


def combine_splits(out, dtype):
    """A split kernel's partials (acc, max, sum) [B, KVH, P, R, D | 1] -> the output [B, KVH, R,
    D]: each split's accumulator rescaled to the common max, summed, normalised."""
    if not isinstance(out, (tuple, list)):
        return out
    acc, m, l = out
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))
    num, den = jnp.sum(w * acc, axis=2), jnp.sum(w * l, axis=2)
    return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0).astype(dtype)


def kernel_init(rows: int, d: int):
    """The online softmax's (max, sum, accumulator) of a kernel program's query block."""
    return (jnp.full((rows, 1), NEG_SCORE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))


def kernel_tile(carry, q, kt, vt, ok, scale):
    """One K/V tile [T, D] into a kernel program's online softmax over its query block q [R, D];
    `ok` [R, T]: which (query, key) pairs the cache rule allows."""
    m, l, acc = carry
    sc = jax.lax.dot_general(q, kt, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * scale         # [R, T]
    sc = jnp.where(ok, sc, NEG_SCORE)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
    p = jnp.where(ok, jnp.exp(sc - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=1, keepdims=True)
    acc = acc * corr + jnp.dot(p.astype(vt.dtype), vt, preferred_element_type=jnp.float32)
    return m_new, l, acc


def kernel_result(l, acc, dtype):
    return jnp.where(l > 0, acc / jnp.maximum(l, 1e-30), 0.0).astype(dtype)


def query_block(q, kvh: int, dtype):
    """q [B, S, H, D] -> [B, KVH, R, D]: each KV head's S x G query heads (row r = slot r // G),
    padded to R = a power of two >= 16 rows (the Triton lowering's block shapes)."""
    b, s, h, d = q.shape
    rows = s * (h // kvh)
    r_pad = max(16, pow2_at_least(rows))
    qr = q.reshape(b, s, kvh, h // kvh, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, rows, d)
    return jnp.pad(qr, ((0, 0), (0, 0), (0, r_pad - rows), (0, 0))).astype(dtype)


def from_query_block(out, s: int, h: int):
    """The inverse of `query_block` on a kernel's output [B, KVH, R, D] -> [B, S, H, D]."""
    b, kvh, _, d = out.shape
    g = h // kvh
    out = out[:, :, :s * g].reshape(b, kvh, s, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, s, h, d)


def triton_params(interpret: bool, warps: int = 4) -> dict:
    """pallas_call's compiler parameters: the Triton lowering's (not Mosaic GPU's) when compiled,
    `warps` warps a program."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as plgpu
    return {"compiler_params": plgpu.CompilerParams(num_warps=warps, num_stages=PALLAS_STAGES)}


def _static_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def attend_cache_pallas(q, k, v, cache_len, scale: float, tile: int, *,
                        interpret: bool = False, layer: int | None = None,
                        splits: int | None = None):
    """Cache-mode attention as a Pallas kernel: grid (B, KVH, query blocks x splits), each
    program walks its own row's live tiles up to its block's last query, ceil((cache_len[b] +
    slot + 1) / tile_used). The tile used is the largest power of two <= min(tile, T) (power-of-
    two blocks for the Triton lowering); the S x G query heads of a KV head, padded to a power of
    two >= 16 rows, are cut into blocks of QUERY_BLOCK rows (a prefill chunk: many programs, not
    one holding every row). With `layer` (a Python int), k and v are the stacked cache [L, B, T,
    KVH, D] and the kernel's blocks read that layer's rows in place (no copy of the layer's
    slice). `splits` > 1 cuts each program's live tiles into that many parts, one program each,
    their partial softmaxes combined after (`combine_splits`); None: `auto_splits` (a small batch
    fills the GPU). `interpret=True` runs the kernel in Pallas interpret mode (any platform)."""
    from jax.experimental import pallas as pl
    if layer is not None:
        if not _static_int(layer) or k.ndim != 5 or not 0 <= layer < k.shape[0]:
            raise ValueError(f"layer must be a Python int in [0, {k.shape[0] if k.ndim == 5 else '?'}) "
                             f"with the stacked cache [L, B, T, KVH, D]; got layer {layer!r}, "
                             f"k {tuple(k.shape)}")
        _check(q, k[0], v[0], cache_len)
    else:
        _check(q, k, v, cache_len)
    b, s, h, d = q.shape
    t, kvh = k.shape[-3], k.shape[-2]
    g = h // kvh
    tile_used = pow2_at_most(min(check_tile(tile), t))
    qr = query_block(q, kvh, k.dtype)
    rb = query_rows(s * g)
    blocks = qr.shape[2] // rb
    lens = jnp.asarray(cache_len, jnp.int32).reshape(b, 1)
    splits = (auto_splits(b * kvh * blocks, -(-t // tile_used)) if splits is None
              else check_int_at_least("splits", splits, 1))
    kernel = functools.partial(_pallas_kernel, scale=float(scale), tile=tile_used, groups=g,
                               width=s, capacity=t, splits=splits)
    if layer is None:
        kv_spec = pl.BlockSpec((None, t, None, d), lambda i, j, c: (i, 0, j, 0))
    else:
        kv_spec = pl.BlockSpec((None, None, t, None, d), lambda i, j, c: (layer, i, 0, j, 0))
    out_shape, out_specs = split_outputs(b, kvh, blocks, rb, d, q.dtype, splits)
    out = combine_splits(pl.pallas_call(
        kernel,
        grid=(b, kvh, blocks * splits),
        in_specs=[pl.BlockSpec((None, 1), lambda i, j, c: (i, 0)),
                  pl.BlockSpec((None, None, rb, d), lambda i, j, c: (i, j, c // splits, 0)),
                  kv_spec, kv_spec],
        out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name="wedlm_cache_attention", **triton_params(interpret),
    )(lens, qr, k, v), q.dtype)
    return from_query_block(out, s, h).astype(q.dtype)


# ------------------------------------------------------------------------------------- cuDNN

def cudnn_arguments(cache_len, num_new: int, capacity: int) -> dict:
    """The keyword arguments of `jax.nn.dot_product_attention` that express the cache rule:
    per-row key lengths min(cache_len + S, T) and the in-window causality as a mask [B, 1, S, T]
    (`cache_mask`: key t <= cache_len[b] + i), all query rows valid."""
    cache_len = jnp.asarray(cache_len, jnp.int32)
    b = cache_len.shape[0]
    return {"mask": cache_mask(cache_len, num_new, capacity)[:, None],
            "query_seq_lengths": jnp.full((b,), num_new, jnp.int32),
            "key_value_seq_lengths": jnp.minimum(cache_len + num_new, capacity).astype(jnp.int32)}


def attend_cache_cudnn(q, k, v, cache_len, scale: float, *, implementation: str = "cudnn"):
    """Cache-mode attention through `jax.nn.dot_product_attention` (cuDNN flash attention on GPU,
    bf16/fp16). `implementation="xla"` runs the same call through XLA (any platform)."""
    _check(q, k, v, cache_len)
    args = cudnn_arguments(cache_len, q.shape[1], k.shape[1])
    out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=scale,
                                       implementation=implementation, **args)
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------------- dispatch

def attend_cache(impl: str, q, k, v, cache_len, scale: float, *, tile: int = 256,
                 interpret: bool = False, layer=None):
    """Run cache-mode implementation `impl` (one of IMPLEMENTATIONS). `tile`: the KV tile of
    "tiled" and "pallas"; `interpret`: Pallas interpret mode / cuDNN's argument set through XLA
    (for checking the accelerator kernels on CPU). With `layer`, k and v are the stacked cache
    [L, B, T, KVH, D]: "tiled" reads its tiles from that layer in place; the others take the
    layer's slice (a copy of it at every call), except "pallas" with a static `layer` (a Python
    int: the layers unrolled, as the Decoder runs them on GPU), whose blocks read the stacked
    cache where it lies. An int8 cache (`kv_quant`) is read by "tiled" (a tile dequantized at a
    time) and "dense" (the layer dequantized); the kernels refuse it."""
    if kv_quant.is_quantized(k) and impl in BACKENDS and not BACKENDS[impl].kv_int8:
        raise kv_quant.refuse(f"{impl} cache attention kernel", f"attention '{TILED}'")
    if impl == TILED:
        return attend_cache_tiles(q, k, v, cache_len, scale, tile, layer)
    if impl == PALLAS and _static_int(layer):   # the kernel's blocks index the stacked cache
        return attend_cache_pallas(q, k, v, cache_len, scale, tile, interpret=interpret,
                                   layer=int(layer))
    if layer is not None:
        k = jax.lax.dynamic_index_in_dim(k, layer, 0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(v, layer, 0, keepdims=False)
    if impl == DENSE:
        k, v = kv_quant.from_cache(k, q.dtype), kv_quant.from_cache(v, q.dtype)
        return attend_cache_dense(q, k, v, cache_len, scale)
    if impl == PALLAS:
        return attend_cache_pallas(q, k, v, cache_len, scale, tile, interpret=interpret)
    if impl == CUDNN:
        return attend_cache_cudnn(q, k, v, cache_len, scale,
                                  implementation="xla" if interpret else "cudnn")
    raise ValueError(f"cache-mode attention must be one of {', '.join(IMPLEMENTATIONS)}; "
                     f"got {impl!r}")
