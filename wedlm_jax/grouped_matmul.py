"""The matmul of a group-quantized kernel on a GPU, as one Pallas (Triton) kernel.

    y = grouped_matmul(x, values, scales, group=64)     # x [M, K]; values [K, N] int4 / int8;
                                                        # scales [K // group, N]; y [M, N]

XLA:GPU fuses the cast of a per-channel int8 / int4 kernel into its gemm, but not a sub-channel
dequantization (values x one scale per `group` rows of the input axis): it writes the
dequantized kernel out at the compute dtype's size and reads it again, so a grouped int4 step
moved 1.93x the bf16 step's bytes (benchmarks/results/quantize). This kernel reads the packed
values and their scales once: each program holds a block of output columns (and of rows), walks
its share of the input axis one group at a time, multiplies the block of x by that group's
values cast to the compute dtype (float32 accumulation) and adds the product scaled by the
group's scales. A small M (a decode step's few rows) leaves few programs, so the input axis is
cut into `splits` parts, each its own program, their float32 partial sums added after.

`interpret=True` runs it in Pallas interpret mode (any platform: the tests check it on CPU
against the dequantized reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

CHOICES = ("xla", "pallas")    # how a model reads grouped kernels: dequantized, or this kernel

BLOCK_N = 64          # output columns per program
MAX_BLOCK_M = 64      # rows of x per program (a prefill chunk is cut into blocks of this many)
TARGET_PROGRAMS = 132  # split the input axis until about this many programs (an H100's SMs)
STAGES = 3            # the Triton pipeline depth
# the most rows a projection sends through the kernel: past them (a prefill chunk, a wide batch
# of windows) the matmul is compute-bound, and XLA's gemm of the dequantized kernel (cuBLAS, the
# kernel written out and read again: ~4.5 bytes a weight) is expected to win over this kernel's
# simple tiles, at about 580 rows if they reach half cuBLAS's rate on an H100 (2.7 TB/s, ~700
# TFLOP/s); the card's qmatmul part times both at the 8B shapes
MAX_ROWS = 512


def supported(k: int, n: int, group: int) -> bool:
    """Whether a [k, n] kernel in groups of `group` has the shapes this kernel tiles: a group a
    power of two >= 16 (the Triton dot's smallest K) that divides k, and n a multiple of BLOCK_N."""
    return (group >= 16 and group & (group - 1) == 0 and k % group == 0
            and n % BLOCK_N == 0)


def for_plan(platform: str, group: int, devices: int) -> str:
    """The grouped matmul a decoding plan takes: the kernel on one GPU for grouped weights;
    XLA's dequantized matmul elsewhere (no grouping, another platform, or weights split over a
    mesh, which a custom call would gather whole)."""
    return "pallas" if group and devices == 1 and platform in ("gpu", "cuda", "rocm") else "xla"


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def choose_splits(m_blocks: int, n_blocks: int, groups: int) -> int:
    """How many parts the input axis is cut into: the fewest that reach TARGET_PROGRAMS
    programs, a divisor of the number of groups (every part whole groups)."""
    have = m_blocks * n_blocks
    for s in range(1, groups + 1):
        if groups % s == 0 and have * s >= TARGET_PROGRAMS:
            return s
    return groups


def _kernel(x_ref, w_ref, s_ref, o_ref, *, group: int, per_split: int, rows: int):
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


@functools.partial(jax.jit, static_argnames=("group", "interpret", "splits"))
def grouped_matmul(x, values, scales, *, group: int, interpret: bool = False,
                   splits: int | None = None):
    """x [M, K] (the compute dtype) times the kernel `values` [K, N] (int4 / int8) whose every
    `group` consecutive rows share one scale per column (`scales` [K // group, N]); [M, N] in x's
    dtype, accumulated in float32. `splits`: parts of the input axis (None: `choose_splits`)."""
    from jax.experimental import pallas as pl
    m, k = x.shape
    n = values.shape[1]
    if values.shape[0] != k or scales.shape != (k // group, n) or not supported(k, n, group):
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)}, values {tuple(values.shape)}, "
                         f"scales {tuple(scales.shape)} in groups of {group}: the values must be "
                         f"[K, N] with N a multiple of {BLOCK_N}, the scales [K // group, N], the "
                         f"group a power of two >= 16 dividing K")
    bm = min(max(16, _pow2_at_least(m)), MAX_BLOCK_M)
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
        functools.partial(_kernel, group=group, per_split=groups // splits, rows=m),
        grid=(grid_n, splits, grid_m),
        in_specs=[pl.BlockSpec((bm, k), lambda j, p, i: (i, 0)),
                  pl.BlockSpec((k, BLOCK_N), lambda j, p, i: (0, j)),
                  pl.BlockSpec((groups, BLOCK_N), lambda j, p, i: (0, j))],
        out_specs=pl.BlockSpec((None, bm, BLOCK_N), lambda j, p, i: (p, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32 if splits > 1 else x.dtype),
        interpret=interpret, name="wedlm_grouped_matmul", **params,
    )(x, values, scales)
    return partial[0] if splits == 1 else partial.sum(axis=0).astype(x.dtype)
