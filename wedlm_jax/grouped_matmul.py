"""The matmul of a group-quantized kernel as one Pallas kernel: Triton on a GPU, Mosaic on a TPU.

    y = grouped_matmul(x, values, scales, group=64, kernel="triton" | "mosaic")
    # x [M, K]; values [K, N] int4 / int8; scales [K // group, N]; y [M, N]

Neither XLA:GPU nor libtpu fuses a sub-channel dequantization (values x one scale per `group`
rows of the input axis) into the matmul: both write the dequantized kernel out at the compute
dtype's size and read it again, so a grouped int4 step moved more bytes than the bf16 step
(BENCHMARKS.md section 11). These kernels read the packed values and their scales once.

- triton: each program holds a block of output columns (and of rows), walks its share of the
  input axis one group at a time, multiplies the block of x by that group's values cast to the
  compute dtype (float32 accumulation) and adds the product scaled by the group's scales. A
  small M (a decode step's few rows) leaves few programs, so the input axis is cut into
  `splits` parts, each its own program, their float32 partial sums added after.
- mosaic: a grid of (column blocks, input blocks) over the whole M; each step casts a block of
  values to the compute dtype, multiplies it by its group scales (spread over each group's rows
  by a 0/1 matmul on the MXU, no reshape) and accumulates x's block times it in a float32 VMEM
  scratch; the column blocks run in parallel over the chip's cores. A projection's heads (q / k
  / v: values [K, H, D]) are read as they are laid out, 8 heads a block, one head's [bk, D] at a
  time: flattened to [K, H x D] they would be copied into another tiling at every step.

`interpret=True` runs either in Pallas interpret mode (any platform: the tests check both on CPU
against the dequantized reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from wedlm_jax.buckets import pow2_at_least

XLA, PALLAS = "xla", "pallas"
CHOICES = (XLA, PALLAS)    # how a model reads grouped kernels: dequantized, or a kernel here
KERNELS = ("triton", "mosaic")

BLOCK_N = 64          # triton: output columns per program
MAX_BLOCK_M = 64      # rows of x per program (a prefill chunk is cut into blocks of this many)
TARGET_PROGRAMS = 132  # split the input axis until about this many programs (an H100's SMs)
STAGES = 3            # the Triton pipeline depth
# the most rows a projection sends through each kernel; past them XLA's gemm of the dequantized
# kernel runs. Mosaic (TPU): a prefill chunk or a wide batch of windows is compute-bound, where
# XLA's gemm is expected to win over the kernel's simple tiles. Triton (GPU): measured at the 8B
# shapes, the kernel ties or wins at 8 rows and XLA's gemm wins from 256 rows on (BENCHMARKS.md
# section 8, `python -m benchmarks.gpu.on_gpu --parts probes,qmatmul`), so only AR-sized inputs take it
MAX_ROWS = {"mosaic": 512, "triton": 8}


# mosaic: the input and column blocks tried, largest first (lane multiples of 128)
MOSAIC_BLOCK_K = (1024, 512, 256, 128)
MOSAIC_BLOCK_N = (512, 256, 128)


def supported(k: int, n: int, group: int, kernel: str = "triton") -> bool:
    """Whether a [k, n] kernel in groups of `group` has shapes `kernel` tiles. triton: a group a
    power of two >= 16 (the Triton dot's smallest K) that divides k, n a multiple of BLOCK_N.
    mosaic: `mosaic_blocks` finds blocks."""
    if kernel == "mosaic":
        return mosaic_blocks(k, n, group) is not None
    return (group >= 16 and group & (group - 1) == 0 and k % group == 0
            and n % BLOCK_N == 0)


def mosaic_blocks(k: int, n: int, group: int) -> tuple[int, int] | None:
    """(input block, column block) of the Mosaic kernel for a [k, n] kernel in groups of
    `group`, or None: the input block whole groups, a multiple of 128 dividing k (or k itself)
    whose scale rows are a multiple of 8 (or all of them); the column block a multiple of 128
    dividing n."""
    if group < 1 or k % group:
        return None
    bks = [b for b in MOSAIC_BLOCK_K if k % b == 0 and b % group == 0 and (b // group) % 8 == 0]
    if not bks and k % 128 == 0:
        bks = [k]
    bns = [b for b in MOSAIC_BLOCK_N if n % b == 0]
    return (bks[0], bns[0]) if bks and bns else None


def mosaic_heads(k: int, h: int, d: int, group: int) -> tuple[int, int] | None:
    """(input block, heads per block) of the Mosaic kernel for values [k, h, d] (a projection's
    heads: q / k / v), or None: d a multiple of 128 (the lanes), the input block as
    `mosaic_blocks`', 8 heads a block (or all of them, when fewer)."""
    blocks = mosaic_blocks(k, 128, group)
    hb = h if h <= 8 else (8 if h % 8 == 0 else None)
    return (blocks[0], hb) if blocks and hb and d % 128 == 0 else None


def kernel_for(platform: str) -> str:
    """The KERNELS entry that runs on `platform` ("gpu": triton, "tpu": mosaic); ValueError
    elsewhere."""
    if platform in ("gpu", "cuda", "rocm"):
        return "triton"
    if platform == "tpu":
        return "mosaic"
    raise ValueError(f"the grouped matmul kernels run on a GPU (Triton) or a TPU (Mosaic), not "
                     f"{platform!r}; use grouped_matmul 'xla'")


def for_plan(platform: str, group: int, devices: int) -> str:
    """The grouped matmul a decoding plan takes: a kernel on one GPU or TPU for grouped weights;
    XLA's dequantized matmul elsewhere (no grouping, a CPU, or weights split over a mesh, which
    a custom call would gather whole)."""
    return (PALLAS if group and devices == 1 and platform in ("gpu", "cuda", "rocm", "tpu")
            else XLA)


def choose_splits(m_blocks: int, n_blocks: int, groups: int) -> int:
    """How many parts the input axis is cut into: the fewest that reach TARGET_PROGRAMS
    programs, a divisor of the number of groups (every part whole groups)."""
    have = m_blocks * n_blocks
    for s in range(1, groups + 1):
        if groups % s == 0 and have * s >= TARGET_PROGRAMS:
            return s
    return groups


def _triton_kernel(x_ref, w_ref, s_ref, o_ref, *, group: int, per_split: int, rows: int):
    """One (column block, split, row block) program: x_ref [bm, K] (rows past `rows` masked),
    w_ref [K, bn] (int), s_ref [K // group, bn], o_ref [bm, bn]: the product (one split) or this
    split's float32 partial sum; rows past `rows` not written."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton
    bm = o_ref.shape[0]
    live = (pl.program_id(2) * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < rows
    first = pl.program_id(1) * per_split

    def body(i, acc):
        g = first + i
        xs = pltriton.load(x_ref.at[:, pl.ds(g * group, group)], mask=live, other=0)
        w = w_ref[pl.ds(g * group, group), :].astype(xs.dtype)
        part = jnp.dot(xs, w, preferred_element_type=jnp.float32)
        return acc + part * s_ref[pl.ds(g, 1), :].astype(jnp.float32)

    acc = jax.lax.fori_loop(0, per_split, body, jnp.zeros(o_ref.shape, jnp.float32))
    pltriton.store(o_ref, acc.astype(o_ref.dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("group", "kernel", "interpret", "splits"))
def grouped_matmul(x, values, scales, *, group: int, kernel: str = "triton",
                   interpret: bool = False, splits: int | None = None):
    """x [M, K] (the compute dtype) times the kernel `values` [K, N] (int4 / int8) whose every
    `group` consecutive rows share one scale per column (`scales` [K // group, N]); [M, N] in x's
    dtype, accumulated in float32, by the Pallas `kernel` (KERNELS). The mosaic kernel also takes
    values [K, H, D] (a projection's heads: `mosaic_heads`) and scales [K // group, H, D] for an
    output [M, H, D], read in their own layout. `splits` (triton): parts of the input axis (None:
    `choose_splits`)."""
    m, k = x.shape
    if kernel not in KERNELS:
        raise ValueError(f"grouped_matmul: kernel {kernel!r} is unknown; allowed: "
                         f"{', '.join(KERNELS)}")
    if kernel == "mosaic" and values.ndim == 3 and values.shape[0] == k and \
            scales.shape == (k // group,) + values.shape[1:] and mosaic_heads(*values.shape, group):
        return _mosaic_matmul(x, values, scales, group, interpret)
    n = values.shape[1]
    if values.ndim != 2 or values.shape[0] != k or scales.shape != (k // group, n) or \
            not supported(k, n, group, kernel):
        need = (f"N a multiple of {BLOCK_N}, the group a power of two >= 16 dividing K"
                if kernel == "triton" else "K and N multiples of 128, the group dividing K")
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)}, values {tuple(values.shape)}, "
                         f"scales {tuple(scales.shape)} in groups of {group}: the {kernel} kernel "
                         f"takes values [K, N] and scales [K // group, N] with {need}")
    if kernel == "mosaic":
        return _mosaic_matmul(x, values, scales, group, interpret)
    return _triton_matmul(x, values, scales, group, interpret, splits)


def _triton_matmul(x, values, scales, group: int, interpret: bool, splits: int | None):
    """`grouped_matmul` by the Triton kernel (`_triton_kernel`)."""
    from jax.experimental import pallas as pl
    m, k = x.shape
    n = values.shape[1]
    bm = min(max(16, pow2_at_least(m)), MAX_BLOCK_M)
    groups = k // group
    grid_n, grid_m = n // BLOCK_N, -(-m // bm)
    splits = splits or choose_splits(grid_m, grid_n, groups)
    if groups % splits:
        raise ValueError(f"grouped_matmul: splits {splits} does not divide the {groups} groups")
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton
        params = {"compiler_params": pltriton.CompilerParams(num_warps=4, num_stages=STAGES)}
    partial = pl.pallas_call(
        functools.partial(_triton_kernel, group=group, per_split=groups // splits, rows=m),
        grid=(grid_n, splits, grid_m),
        in_specs=[pl.BlockSpec((bm, k), lambda j, p, i: (i, 0)),
                  pl.BlockSpec((k, BLOCK_N), lambda j, p, i: (0, j)),
                  pl.BlockSpec((groups, BLOCK_N), lambda j, p, i: (0, j))],
        out_specs=pl.BlockSpec((None, bm, BLOCK_N), lambda j, p, i: (p, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32 if splits > 1 else x.dtype),
        interpret=interpret, name="wedlm_grouped_matmul", **params,
    )(x, values, scales)
    return partial[0] if splits == 1 else partial.sum(axis=0).astype(x.dtype)


def _mosaic_kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, group: int):
    """One (column block, input block) step: x_ref [M, bk]; w_ref [bk, bn] (int), s_ref
    [bk // group, bn], o_ref and acc_ref (float32) [M, bn]; or, for a projection's heads, w_ref
    [bk, hb, D], s_ref [bk // group, hb, D], o_ref and acc_ref [M, hb, D], one head's [bk, D]
    at a time. o_ref is written at the last input block."""
    from jax.experimental import pallas as pl
    step = pl.program_id(1)

    @pl.when(step == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    bk = w_ref.shape[0]
    dtype = x_ref.dtype
    spread = _spread(bk, group, dtype)
    x = x_ref[...]
    whole = slice(None)
    parts = [(whole, whole)] if w_ref.ndim == 2 else [(whole, h, whole)
                                                      for h in range(w_ref.shape[1])]
    for part in parts:
        scale = jnp.dot(spread, s_ref[part].astype(dtype), preferred_element_type=jnp.float32)
        w = w_ref[part].astype(dtype) * scale.astype(dtype)
        acc_ref[part] += jnp.dot(x, w, preferred_element_type=jnp.float32)

    @pl.when(step == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _spread(bk: int, group: int, dtype):
    """[bk, bk // group] 0/1: row r takes scale row r // group (a matmul spreads the scales)."""
    shape = (bk, bk // group)
    return (jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, shape, 0), group)
            == jax.lax.broadcasted_iota(jnp.int32, shape, 1)).astype(dtype)


def _mosaic_matmul(x, values, scales, group: int, interpret: bool):
    """`grouped_matmul` by the Mosaic kernel (`_mosaic_kernel`): values [K, N] in blocks of
    columns (`mosaic_blocks`), or [K, H, D] in blocks of heads (`mosaic_heads`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    m, k = x.shape
    outs = values.shape[1:]
    bk, cols = mosaic_heads(k, *outs, group) if len(outs) == 2 else mosaic_blocks(k, outs[0], group)
    block, rest = (cols,) + outs[1:], (0,) * (len(outs) - 1)
    params = {} if interpret else {"compiler_params": pltpu.CompilerParams(
        dimension_semantics=("parallel", "arbitrary"))}
    return pl.pallas_call(
        functools.partial(_mosaic_kernel, group=group),
        grid=(outs[0] // cols, k // bk),
        in_specs=[pl.BlockSpec((m, bk), lambda j, i: (0, i)),
                  pl.BlockSpec((bk,) + block, lambda j, i: (i, j) + rest),
                  pl.BlockSpec((bk // group,) + block, lambda j, i: (i, j) + rest)],
        out_specs=pl.BlockSpec((m,) + block, lambda j, i: (0, j) + rest),
        out_shape=jax.ShapeDtypeStruct((m,) + outs, x.dtype),
        scratch_shapes=[pltpu.VMEM((m,) + block, jnp.float32)],
        interpret=interpret, name="wedlm_grouped_matmul", **params,
    )(x, values, scales)
