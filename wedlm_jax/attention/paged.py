"""Attention over a paged KV cache: the device side. `decode/engine/runtime/pages.py` decides which
pages each sequence holds; here they are read and written.

Layout (the one jax's TPU ragged paged attention kernel reads, so no copy stands between them):

    pool        [L * P, page, 2 * KVH, D]: the pages of every layer in one buffer, layer l's pages
                at l * P .. l * P + P - 1 (`first_page` = l * P: a layer is an offset, never a
                slice, so the kernel and the gathers read the stacked buffer in place); page p
                holds `page` consecutive rows of one sequence; keys and values interleaved on
                the head axis (k of head h at 2h, v at 2h + 1).
    page_table  [B, pages_per_seq] int32: the pages of sequence b in order, ids in [0, P) the
                same for every layer (row r of the sequence is row r % page of page
                page_table[b, r // page]); entries past what a sequence holds are UNMAPPED.
    cache_len   [B] int32: committed rows of each sequence (the cache rule is the dense cache's,
                `attention.cache_last_key`: the query at physical index i of a forward, its K/V
                written at row cache_len[b] + i, sees rows 0 .. cache_len[b] + i).

    layer_step(q, k, v, cache, cache_len, layer, num_layers, ...)   one layer of the model: the
                                                              new rows written, then attention
                                                              (per shard of a mesh, below)
    write_pages(pool, k, v, page_table, cache_len, first_page)  the S new rows of every sequence
    attend_pages(impl, q, pool, page_table, cache_len, scale,   "gather" (XLA, any platform: a loop
                 first_page=...)
                                                              over tiles of pages, as many as the
                                                              longest sequence needs), "ragged"
                                                              (jax's TPU Pallas kernel) or "triton"
                                                              (ours, GPU: each sequence's live
                                                              pages read in place; jax's GPU paged
                                                              kernel takes one query a sequence,
                                                              a window has up to 2W)

Rows whose page is UNMAPPED (a free slot's window, a sequence's rows past its pages) are dropped on
write and masked on read, so they cannot touch another sequence's pages.

On a mesh with slots over data x fsdp (D shards of the batch), each shard keeps a pool of its own:
P = D x P_local pages per layer, page ids shard-major (shard d owns ids d * P_local .. + P_local - 1,
and a slot of shard d holds only those), and the pool's rows ordered shard-major too (shard d's
L x P_local pages, layer l's at l * P_local within them, the single-device layout), so the pool
split over data x fsdp on its first axis gives every shard exactly its own pages. `layer_step`
then runs the write and the attention per shard (`jax.shard_map`) on local ids. With D = 1 the
ids and rows are the single-device ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from wedlm_jax.attention import cache as ca
from wedlm_jax.attention import kv_quant
from wedlm_jax.attention.core import cache_last_key
from wedlm_jax.attention.table import AUTO, PALLAS, TILED

UNMAPPED = -1
GATHER, RAGGED, TRITON = "gather", "ragged", "triton"     # the paged implementations
IMPLEMENTATIONS = (GATHER, RAGGED, TRITON)


@struct.dataclass
class PagedContext:
    """What every layer's attention gets in paged cache mode (built once per forward)."""
    cache_len: jax.Array                                          # [B] int32
    impl: str = struct.field(pytree_node=False, default=GATHER)  # gather | ragged | triton
    pages_per_tile: int = struct.field(pytree_node=False, default=4)
    interpret: bool = struct.field(pytree_node=False, default=False)  # triton: CPU-checkable


def paged_cache_logical_axes() -> dict:
    """Tree (matching `init_paged_cache`) of logical-axis tuples: the pool's pages over the slot
    shards ('pages': data x fsdp; each shard's own pages, see the module docstring), its
    interleaved K/V heads over 'tensor' (contiguous blocks of 2 x KVH / t rows: each device holds
    the keys and values of its own heads of every page, as the projections make them), the page
    table by slot."""
    return {"pool": ("pages", None, "kv_heads", None), "table": ("batch", None)}


def init_paged_cache(num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                     batch: int, pages_per_seq: int, dtype=jnp.float32) -> dict:
    """The paged cache, empty: {"pool": [L * P, page, 2 * KVH, D] zeros, "table": [B,
    pages_per_seq] UNMAPPED}; P = `num_pages` pages per layer. An int8 `dtype`: rows of D values
    and their scale (`kv_quant`, D + 4 wide)."""
    width = kv_quant.cache_width(head_dim, dtype)
    return {"pool": jnp.zeros((num_layers * num_pages, page_size, 2 * kv_heads, width), dtype),
            "table": jnp.full((batch, pages_per_seq), UNMAPPED, jnp.int32)}


def is_paged(kv_cache) -> bool:
    return isinstance(kv_cache, dict) and "pool" in kv_cache


def implementation_for(platform: str | None, attention: str = TILED) -> str:
    """The TPU kernel on TPU; elsewhere the Triton kernel when `attention` asks for the Pallas
    kernel ("pallas": the Decoder asks for it on GPU where `triton_fits`), else the XLA gather
    path."""
    if platform == "tpu":
        return RAGGED
    return TRITON if attention == PALLAS else GATHER


# The page size a Decoder takes on TPU when none is asked for: there the paged cache with jax's
# ragged paged attention kernel compiles to fewer bytes per decode step than the dense cache's
# tiled XLA attention, the kernel keeping each tile's scores on chip (BENCHMARKS.md section 7,
# "What each default buys").
TPU_PAGE_SIZE = 64
# On GPU a continuous-batching door (the server, the batch job) takes pages of 64 rows, read by
# the Triton paged kernel where its pages fit the GPU's shared memory (`choose_attention`): it
# steps only the live slots' bucket (a lone request no longer pays for the idle slots) and reuses
# shared prompt prefixes, as on CPU, at the dense cache's bytes and speed (BENCHMARKS.md
# section 8). The paged cache's XLA gather path, slower than the dense cache's Triton kernel
# (section 8), is used only where the Triton paged kernel cannot run. A static batch keeps the
# dense cache (it has no prefixes to share and its slots are all live).
GPU_PAGE_SIZE = 64
# On CPU a continuous-batching door (the server, the batch job) takes pages of 16 rows: there the
# paged cache steps as fast as the dense one under load, steps only the live slots' bucket (a
# lone request no longer pays for the idle slots) and reuses shared prompt prefixes
# (BENCHMARKS.md, sections 4 and 5). A static batch keeps the dense cache.
CPU_CONTINUOUS_PAGE_SIZE = 16
# ... and its gather loop's tile on GPU, in rows: one iteration per 16 pages of 64. Each
# iteration is a dozen small kernels, so a tile of one page left the step bound by their launches;
# past 16 pages a larger tile gains little (BENCHMARKS.md section 8)
GPU_GATHER_ROWS = 1024


def auto_page_size(platform: str | None, num_heads: int, kv_heads: int, head_dim: int, dtype,
                   tensor: int = 1, *, continuous: bool = False) -> int:
    """The page size of the cache a Decoder builds when none is asked for: TPU_PAGE_SIZE on TPU
    where the ragged kernel reads the heads (`check_ragged`; slots over data x fsdp or not: a
    pool per shard); for a `continuous`-batching door GPU_PAGE_SIZE on GPU and CPU_CONTINUOUS_PAGE_SIZE on CPU;
    else 0 (the dense cache)."""
    if platform in ("gpu", "cuda", "rocm"):
        return GPU_PAGE_SIZE if continuous else 0
    if implementation_for(platform) != RAGGED:
        return CPU_CONTINUOUS_PAGE_SIZE if continuous and platform == "cpu" else 0
    try:
        check_ragged(num_heads, kv_heads, head_dim, dtype, tensor)
    except ValueError:
        return 0
    return TPU_PAGE_SIZE


def gather_tile(platform: str | None, kv_tile: int, page_size: int) -> int:
    """Rows per iteration of the gather path's loop over pages (a whole number of pages): at
    least GPU_GATHER_ROWS on GPU, where each iteration costs launches and a predicate read;
    `kv_tile` elsewhere."""
    rows = max(kv_tile, GPU_GATHER_ROWS) if platform in ("gpu", "cuda", "rocm") else kv_tile
    return max(page_size, rows // page_size * page_size)


# jax's TPU ragged paged attention kernel keeps each query row's running max and sum in rows of
# 128 lanes and broadcasts them across head_dim by whole copies (an AssertionError inside the
# kernel's tracing otherwise): it reads heads of a multiple of 128 values only.
RAGGED_HEAD_DIM_MULTIPLE = 128


def check_ragged(num_heads: int, kv_heads: int, head_dim: int, dtype, tensor: int = 1) -> None:
    """A ValueError naming the heads unless jax's TPU ragged paged attention kernel can read them:
    head_dim a multiple of RAGGED_HEAD_DIM_MULTIPLE, and the K/V heads interleaved in the pool
    (2 x KVH) filling the TPU's tiles (the kernel's own rule, asked of the kernel before anything
    compiles); with heads over `tensor` devices, each device's share."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk
    if head_dim % RAGGED_HEAD_DIM_MULTIPLE:
        raise ValueError(f"the TPU ragged paged attention kernel reads heads of a multiple of "
                         f"{RAGGED_HEAD_DIM_MULTIPLE} values; this model's head_dim is {head_dim}")
    try:
        get_min_heads_per_blk(num_heads // tensor, 2 * kv_heads // tensor, dtype, dtype)
    except (ValueError, AssertionError) as e:
        per = f" ({kv_heads // tensor} per device over tensor={tensor})" if tensor > 1 else ""
        raise ValueError(f"the TPU ragged paged attention kernel cannot tile {kv_heads} KV heads{per} "
                         f"(2 x {kv_heads // tensor} interleaved K/V rows of {jnp.dtype(dtype).name}): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def check_paged_cache(num_layers: int, kv_heads: int, head_dim: int, batch: int, kv_cache) -> None:
    """A ValueError naming what is wrong unless `kv_cache` is `init_paged_cache`'s structure."""
    if set(kv_cache) != {"pool", "table"}:
        raise ValueError(f"a paged cache is the dict {{'pool', 'table'}}; got keys {sorted(kv_cache)}")
    pool, table = kv_cache["pool"], kv_cache["table"]
    width = kv_quant.cache_width(head_dim, pool.dtype)
    if pool.ndim != 4 or pool.shape[0] % num_layers or tuple(pool.shape[2:]) != (2 * kv_heads, width):
        raise ValueError(f"the page pool has shape {tuple(pool.shape)}; the model needs [layers x "
                         f"pages, page, 2 x kv_heads = {2 * kv_heads}, head_dim = {width}] with "
                         f"a multiple of {num_layers} pages (attention.paged.init_paged_cache)")
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"the page table has shape {tuple(table.shape)}; expected [{batch}, pages "
                         "per sequence]")


def interleave(k, v):
    """[.., KVH, D] keys and values -> [.., 2 * KVH, D] (k of head h at 2h, v at 2h + 1)."""
    return jnp.stack([k, v], axis=-2).reshape(k.shape[:-2] + (2 * k.shape[-2], k.shape[-1]))


def row_pages(page_table, rows, page_size: int):
    """(page, offset in the page) of each row index in `rows` [B, N] of each sequence; a row
    past the table or on an UNMAPPED entry comes back as page UNMAPPED."""
    idx = jnp.clip(rows // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, idx, axis=1)
    page = jnp.where(rows // page_size < page_table.shape[1], page, UNMAPPED)
    return page, rows % page_size


def write_pages(pool, k, v, page_table, cache_len, first_page=0):
    """The new K/V [B, S, KVH, D] of every sequence written at rows cache_len[b] .. + S - 1 of its
    pages (of the layer whose pages start at `first_page`; in place when `pool` is donated);
    rows without a page are dropped."""
    b, s = k.shape[:2]
    p, page_size = pool.shape[:2]
    rows = jnp.asarray(cache_len, jnp.int32)[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    page, off = row_pages(page_table, rows, page_size)
    page = jnp.where(page < 0, p, page + first_page)          # out of bounds: dropped
    return pool.at[page, off].set(kv_quant.to_cache(interleave(k, v), pool.dtype), mode="drop")


def gather_rows(pool, page_table, start_page, num_pages: int, first_page=0):
    """Rows of pages start_page .. + num_pages - 1 of every sequence: (k, v) [B, num_pages * page,
    KVH, D] and whether each row's page is mapped [B, num_pages * page] (an int8 pool's rows as
    stored, D + 4 wide: `kv_quant.from_cache` reads them)."""
    b = page_table.shape[0]
    cols = start_page + jnp.arange(num_pages, dtype=jnp.int32)
    cols_c = jnp.clip(cols, 0, page_table.shape[1] - 1)
    pages = page_table[:, cols_c]                                          # [B, n]
    mapped = (pages >= 0) & (cols < page_table.shape[1])[None]
    p, page, kvh2, d = pool.shape
    pairs = pool.reshape(p, page, kvh2 // 2, 2, d)          # a view: k of head h at [.., h, 0, :]
    ids = jnp.maximum(pages, 0) + first_page
    # one gather each for k and v, straight from the pool through a [.., KVH, 2, D] view: no split
    # of a gathered tile afterwards (XLA:CPU copied it twice: BENCHMARKS.md section 4), and no
    # strided slice (XLA:GPU answered one with a transpose of the whole pool)
    k, v = (pairs[ids, :, :, j, :].reshape(b, num_pages * page, kvh2 // 2, d) for j in (0, 1))
    return k, v, jnp.repeat(mapped, page, axis=1)


def attend_pages_gather(q, pool, page_table, cache_len, scale: float, pages_per_tile: int = 4,
                        first_page=0):
    """The cache rule over pages in pure JAX: an online softmax over tiles of `pages_per_tile`
    pages of each sequence, ceil((max_b cache_len[b] + S) / tile rows) of them (a runtime trip
    count: the tiles up to the longest live sequence, not the table's width)."""
    b, s, h, d = q.shape
    page_size, kvh = pool.shape[1], pool.shape[2] // 2
    g = h // kvh
    width = page_table.shape[1]
    ppt = max(1, min(int(pages_per_tile), width))
    tile = ppt * page_size
    last = cache_last_key(jnp.asarray(cache_len, jnp.int32), s)                 # [B, S]
    n_tiles = (jnp.max(last) + 1 + tile - 1) // tile
    qr = q.reshape(b, s, kvh, g, d)

    def body(t, carry):
        kt, vt, mapped = gather_rows(pool, page_table, t * ppt, ppt, first_page)
        kt, vt = kv_quant.from_cache(kt, q.dtype), kv_quant.from_cache(vt, q.dtype)
        idx = t * tile + jnp.arange(tile, dtype=jnp.int32)
        ok = (idx[None, None, :] <= last[:, :, None]) & mapped[:, None, :]        # [B, S, tile]
        return ca.online_softmax_step(carry, qr, kt, vt, ok[:, None, None], scale)

    _, l, acc = jax.lax.fori_loop(0, n_tiles, body, ca.online_softmax_init(b, kvh, g, s, d))
    return ca.online_softmax_result(l, acc, q)


def attend_pages_ragged(q, pool, page_table, cache_len, scale: float, first_page=0, **kernel_args):
    """The cache rule through jax's TPU ragged paged attention kernel: every sequence's S queries
    are its newest rows (kv_lens = cache_len + S, new K/V already written), causal in physical
    order, which is exactly the rule above. Unmapped table entries are pointed at page 0: the
    kernel reads only the pages kv_lens covers, all mapped for live sequences. A Mosaic call is
    not partitioned by XLA: on a mesh, `layer_step` calls this per device."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    b, s, h, d = q.shape
    # explicit block sizes: the kernel's own tuning reads the local device's TPU generation, which
    # an ahead-of-time compile from another machine does not have
    kernel_args.setdefault("num_kv_pages_per_block",
                           max(1, min(page_table.shape[1], 128 // pool.shape[1])))
    kernel_args.setdefault("num_queries_per_block", min(32, b * s))
    kv_lens = jnp.asarray(cache_len, jnp.int32) + s
    cu_q = jnp.arange(b + 1, dtype=jnp.int32) * s

    def kernel(q2, pool2, kv_lens, pages, cu_q, num_seqs):
        return ragged_paged_attention(q2, pool2, kv_lens, pages, cu_q, num_seqs,
                                      sm_scale=float(scale), **kernel_args)

    out = kernel(q.reshape(b * s, h, d), pool, kv_lens, jnp.maximum(page_table, 0) + first_page,
                 cu_q, jnp.array([b], jnp.int32))
    return out.reshape(b, s, h, d).astype(q.dtype)


def _triton_kernel(len_ref, first_ref, q_ref, table_ref, pool_ref, *out_refs, scale, groups,
                   width, splits):
    """One (sequence b, KV head j, query block k x split p) program: q_ref [Rb, D] rows k * Rb..
    of the sequence's query block (`ca.query_block`), table_ref [pages_per_seq] its page ids,
    pool_ref the whole pool. It walks its share (split p of `splits`) of the pages its queries'
    rows span, ceil((cache_len[b] + its last slot + 1) / page), reading K and V of head j from
    each page where it lies. An UNMAPPED entry reads page 0, masked (a free slot's rows)."""
    from jax.experimental import pallas as pl
    n, first, j, c = len_ref[0], first_ref[0], pl.program_id(1), pl.program_id(2)
    k, p = c // splits, c % splits
    page, rb = pool_ref.shape[1], q_ref.shape[0]
    q = q_ref[...]
    slot = (k * rb + jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)) // groups
    last = n + jnp.minimum(slot, width - 1)                                        # [Rb, 1]
    top = n + jnp.minimum((k * rb + rb - 1) // groups, width - 1)
    n_pages = jnp.minimum(top // page + 1, table_ref.shape[0])

    def body(i, carry):
        entry = table_ref[i]
        pid = jnp.maximum(entry, 0) + first
        col = i * page + jax.lax.broadcasted_iota(jnp.int32, (1, page), 1)
        return ca.kernel_tile(carry, q, pool_ref[pid, :, 2 * j, :], pool_ref[pid, :, 2 * j + 1, :],
                              (col <= last) & (entry >= 0), scale)

    lo, hi = ca.split_range(n_pages, p, splits)
    ca.kernel_store(out_refs, jax.lax.fori_loop(lo, hi, body, ca.kernel_init(rb, q_ref.shape[1])))


def triton_fits(page_size: int, head_dim: int, itemsize: int, smem: int) -> bool:
    """Whether the Triton paged kernel compiles for pages of `page_size` rows: power-of-two pages
    of at least 16 rows (the lowering's block shapes), their K/V in every pipeline stage and a
    query block of `ca.QUERY_BLOCK` rows within `smem` bytes of shared memory."""
    return (page_size >= 16 and page_size & (page_size - 1) == 0
            and ca.pallas_smem(page_size, ca.QUERY_BLOCK, head_dim, itemsize) <= smem)


def choose_attention(attention: str, platform: str | None, page_size: int, head_dim: int,
                     itemsize: int, smem: int) -> str:
    """A paged cache's attention off TPU, as a Decoder asks the model for it: "pallas" (the
    Triton paged kernel) when asked for, or with "auto" on GPU, where `triton_fits`; "tiled" (the
    XLA gather path) otherwise; a ValueError when "pallas" is asked for and cannot run. TPU: the
    ragged kernel, whatever is asked."""
    if implementation_for(platform) == RAGGED:
        return attention
    fits = triton_fits(page_size, head_dim, itemsize, smem)
    if attention == PALLAS and (platform != "gpu" or not fits):
        raise ValueError(
            f"attention 'pallas' with a paged cache is the Triton paged kernel: it needs a GPU and "
            f"power-of-two pages of 16+ rows whose K/V and query block fit the device's shared "
            f"memory (page_size {page_size}, head_dim {head_dim}, {itemsize}-byte items, {smem} "
            f"bytes, on {platform}); use attention 'tiled' (the XLA gather path) or 'auto'")
    return PALLAS if platform == "gpu" and attention in (AUTO, PALLAS) and fits else TILED


def attend_pages_triton(q, pool, page_table, cache_len, scale: float, first_page=0,
                        interpret: bool = False, splits: int | None = None):
    """The cache rule over pages as a Pallas (Triton) kernel: grid (B, KVH, query blocks x
    `splits`), each program walks its own sequence's live pages (its split's share of them)
    through the page table and reads them in the pool, in place (no gathered tile, one kernel per
    layer; split partials combined after, `ca.combine_splits`; None: `ca.auto_splits`). GPU;
    anywhere with `interpret=True`."""
    from jax.experimental import pallas as pl
    b, s, h, d = q.shape
    kvh = pool.shape[2] // 2
    qr = ca.query_block(q, kvh, pool.dtype)
    r_pad, width = qr.shape[2], page_table.shape[1]
    rb = ca.query_rows(s * (h // kvh))
    blocks = r_pad // rb
    lens = jnp.asarray(cache_len, jnp.int32).reshape(b, 1)
    first = jnp.asarray(first_page, jnp.int32).reshape(1)
    splits = (ca.auto_splits(b * kvh * blocks, width) if splits is None
              else ca.check_int_at_least("splits", splits, 1))
    kernel = functools.partial(_triton_kernel, scale=float(scale), groups=h // kvh, width=s,
                               splits=splits)
    out_shape, out_specs = ca.split_outputs(b, kvh, blocks, rb, d, q.dtype, splits)
    out = ca.combine_splits(pl.pallas_call(
        kernel,
        grid=(b, kvh, blocks * splits),
        in_specs=[pl.BlockSpec((None, 1), lambda i, j, c: (i, 0)),
                  pl.BlockSpec((1,), lambda i, j, c: (0,)),
                  pl.BlockSpec((None, None, rb, d), lambda i, j, c: (i, j, c // splits, 0)),
                  pl.BlockSpec((None, width), lambda i, j, c: (i, 0)),
                  pl.BlockSpec(pool.shape, lambda i, j, c: (0, 0, 0, 0))],
        out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name="wedlm_paged_attention", **ca.triton_params(interpret),
    )(lens, first, qr, jnp.asarray(page_table, jnp.int32), pool), q.dtype)
    return ca.from_query_block(out, s, h).astype(q.dtype)


def attend_pages(impl: str, q, pool, page_table, cache_len, scale: float, *, pages_per_tile: int = 4,
                 first_page=0, interpret: bool = False, **kernel_args):
    """Run paged implementation `impl` (one of IMPLEMENTATIONS) over the layer whose pages start
    at `first_page` of the pool. An int8 pool (`kv_quant`) is read by "gather" alone."""
    if kv_quant.is_quantized(pool) and impl != GATHER:
        kernel = "TPU ragged paged attention kernel" if impl == RAGGED else "Triton paged kernel"
        raise kv_quant.refuse(kernel, "the dense cache (page_size 0) or attention 'tiled' off TPU")
    if impl == GATHER:
        return attend_pages_gather(q, pool, page_table, cache_len, scale, pages_per_tile, first_page)
    if impl == RAGGED:
        return attend_pages_ragged(q, pool, page_table, cache_len, scale, first_page, **kernel_args)
    if impl == TRITON:
        return attend_pages_triton(q, pool, page_table, cache_len, scale, first_page, interpret)
    raise ValueError(f"paged attention must be one of {', '.join(IMPLEMENTATIONS)}; got {impl!r}")


def shard_page_ids(page_table, shard, pages_per_shard: int):
    """Shard-major page ids -> shard `shard`'s local ids; other shards' pages -> UNMAPPED."""
    local = page_table - shard * pages_per_shard
    return jnp.where((page_table >= 0) & (local >= 0) & (local < pages_per_shard), local, UNMAPPED)


def _mesh_split(mesh, heads: int, kv_heads: int):
    """(the slot shards' mesh axes, the tensor axis or None): how `layer_step` splits its work."""
    if mesh.empty:
        return (), None
    shards = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    t = mesh.shape.get("tensor", 1)
    tensor = "tensor" if t > 1 and heads % t == 0 and kv_heads % t == 0 else None
    return shards, tensor


def copy_pages(pool, src, dst, num_layers: int, heads: int, kv_heads: int):
    """The pool with global pages `dst` [n] holding, in every layer, what pages `src` [n] hold
    (entries < 0 skipped): a cached prefix of one slot shard's pool copied into another's, so a
    request placed there need not prefill it again. Per device with slot shards: each source page
    is read by its owner, summed over the shards (only the copied pages travel), and written by
    the owner of its destination."""
    def run(pool, src, dst, shard, shards):
        per_layer = pool.shape[0] // num_layers
        ls = shard_page_ids(src, shard, per_layer) if shards else src
        ld = shard_page_ids(dst, shard, per_layer) if shards else dst
        layer = jnp.arange(num_layers, dtype=jnp.int32)[:, None] * per_layer
        got = pool[(layer + jnp.maximum(ls, 0)[None]).reshape(-1)]          # [L * n, page, ..]
        owned = jnp.broadcast_to(ls >= 0, (num_layers, ls.shape[0])).reshape(-1)
        got = jnp.where(owned[:, None, None, None], got, jnp.zeros_like(got))
        if shards:
            got = jax.lax.psum(got, shards)
        rows = jnp.where(ld >= 0, layer + ld[None], pool.shape[0]).reshape(-1)   # else dropped
        return pool.at[rows].set(got, mode="drop")

    src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
    mesh = jax.sharding.get_abstract_mesh()
    shards, tensor = _mesh_split(mesh, heads, kv_heads)
    if not shards:
        return run(pool, src, dst, 0, ())
    from jax.sharding import PartitionSpec as P
    spec = P(shards, None, tensor, None)
    fn = jax.shard_map(lambda pool, src, dst: run(pool, src, dst, jax.lax.axis_index(shards), shards),
                       mesh=mesh, in_specs=(spec, P(), P()), out_specs=spec, check_vma=False)
    return fn(pool, src, dst)


def layer_step(q, k, v, cache: dict, cache_len, layer, num_layers: int, *, impl: str,
               scale: float, pages_per_tile: int = 4, interpret: bool = False):
    """One layer in paged cache mode: the new K/V [B, S, KVH, D] written at rows cache_len[b]..
    of each sequence's pages of layer `layer`, then the queries [B, S, H, D] attend over them.
    Returns (out [B, S, H, D], the cache with the written pool).

    Without a mesh (or with heads over 'tensor' on the XLA path, which XLA partitions) this is
    the single-device computation. With slot shards (data x fsdp > 1), or the TPU kernel with
    heads over 'tensor', it runs per device: each shard on its own pages with local ids; a batch
    the shards do not divide (one request's prefill) is seen whole by every shard, written only
    by the shard owning its pages, and its output taken from that shard."""
    pool, table = cache["pool"], cache["table"]
    b, h, kvh = q.shape[0], q.shape[2], k.shape[2]

    def run(q, k, v, pool, table, cache_len, layer, per_layer):
        first = layer * per_layer
        pool = write_pages(pool, k, v, table, cache_len, first)
        out = attend_pages(impl, q, pool, table, cache_len, scale, pages_per_tile=pages_per_tile,
                           first_page=first, interpret=interpret)
        return out, pool

    mesh = jax.sharding.get_abstract_mesh()
    shards, tensor = _mesh_split(mesh, h, kvh)
    if not shards and (impl == GATHER or tensor is None):   # a kernel is not partitioned
        out, pool = run(q, k, v, pool, table, cache_len, layer, pool.shape[0] // num_layers)
        return out, {"pool": pool, "table": table}

    from jax.sharding import PartitionSpec as P
    n_shards = 1
    for a in shards:
        n_shards *= mesh.shape[a]
    split = bool(shards) and b % n_shards == 0
    bs = shards if split else None
    ps = shards or None

    def per_device(q, k, v, pool, table, cache_len, layer):
        per_layer = pool.shape[0] // num_layers
        shard = jax.lax.axis_index(shards) if shards else 0
        local = shard_page_ids(table, shard, per_layer) if shards else table
        out, pool = run(q, k, v, pool, local, cache_len, layer, per_layer)
        if shards and not split:   # the whole batch on every shard: each row from its pages' owner
            owned = jnp.any(local >= 0, axis=1)[:, None, None, None]
            out = jax.lax.psum(jnp.where(owned, out, jnp.zeros_like(out)), shards)
        return out, pool

    rows = P(bs, None, tensor, None)
    pool_spec = P(ps, None, tensor, None)
    fn = jax.shard_map(per_device, mesh=mesh,
                       in_specs=(rows, rows, rows, pool_spec, P(bs, None), P(bs), P()),
                       out_specs=(rows, pool_spec), check_vma=False)
    out, pool = fn(q, k, v, pool, table, jnp.asarray(cache_len, jnp.int32), jnp.asarray(layer, jnp.int32))
    return out, {"pool": pool, "table": table}
