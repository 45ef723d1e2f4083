"""Many LoRA adapters in one batch: an adapter table beside each projection's kernel and one
table row per sequence.

    table = empty_table(config, max_loras=4, max_rank=16, dtype=jnp.float32)
    params = attach(params, table)
    table = write_row(detach(params)[1], 2, adapter_rows(config, adapters, spec, 16))
    logits = Transformer(config).apply({"params": attach(params, table)}, tokens, positions,
                                       lora_index=jnp.asarray([0, 2]))   # row 0: the base

The table: under every projection of the stacked layers (`layers/attn/q_proj`, ...), beside its
`kernel`, `lora_a` [L, N, in, R] and `lora_b` [L, N, R, out] (`in` / `out` the kernel's input /
output axes flattened, as in wedlm_jax/lora/apply.py), N = max_loras + 1 rows, row 0 all zeros (the base
model). R is the rank bound: an adapter of rank r < R fills the first r columns of A and rows of
B, zeros past them; its scale alpha / r is folded into its B at load, so a row adds
`(x @ A[row]) @ B[row]` = `(alpha / r) * x @ A @ B`. Every projection has a table (an adapter
that does not target one leaves it zero there).

The forward (`Transformer(...)(..., lora_index=idx)`, idx [B] int32) gathers each sequence's A and
B rows and adds the two batched products to its projection's output (`low_rank`). The shapes are
fixed by (max_loras, R): any adapter in any row runs the same compiled program, a row is written
by one program for every row (`write_row`, the table donated), and nothing is swapped between
steps. Without `lora_index` (or without a table) the forward is the plain model's, op for op.

Why not qwix's LoRA provider (the training path, wedlm_jax/lora/apply.py): it gives a module one A / B
pair and adds its product to every row of the batch; selecting a different pair per row would
take a table parameter and an index input it has no place for, so the serving path writes the
same product out: a gather and two einsums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax.lora.spec import PROJECTIONS, LoraError, LoraSpec, group_of, projection_sizes

TABLE_LEAVES = ("lora_a", "lora_b")


def low_rank(x, a, b, index, n_in: int, out_shape: tuple, dtype):
    """The adapters' term of a projection: x [B, ..., *ins] (its `n_in` trailing axes the
    kernel's inputs), a [N, in, R], b [N, R, out] (one layer's table), index [B] the row of each
    sequence. Returns [B, ..., *out_shape] in `dtype`."""
    lead = x.shape[:-n_in]
    xf = x.reshape(x.shape[0], -1, a.shape[-2]).astype(dtype)
    ai = jnp.take(a, index, axis=0).astype(dtype)          # [B, in, R]
    bi = jnp.take(b, index, axis=0).astype(dtype)          # [B, R, out]
    h = jnp.einsum("bti,bir->btr", xf, ai)
    return jnp.einsum("btr,bro->bto", h, bi).reshape(lead + tuple(out_shape))


def table_shapes(config, max_loras: int, max_rank: int, dtype=jnp.float32):
    """The table's tree (`{"layers": {group: {projection: {"lora_a", "lora_b"}}}}`) as
    ShapeDtypeStructs: max_loras + 1 rows of rank `max_rank`."""
    n, out = max_loras + 1, {}
    for name, (fan_in, fan_out) in projection_sizes(config).items():
        out.setdefault(group_of(name), {})[name] = {
            "lora_a": jax.ShapeDtypeStruct((config.num_layers, n, fan_in, max_rank), dtype),
            "lora_b": jax.ShapeDtypeStruct((config.num_layers, n, max_rank, fan_out), dtype)}
    return {"layers": out}


def empty_table(config, max_loras: int, max_rank: int, dtype=jnp.float32):
    """The table with every row zero (every sequence decodes with the base weights)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                        table_shapes(config, max_loras, max_rank, dtype))


def zero_rows(config, max_rank: int):
    """One row of every projection's table, zero (NumPy float32, layers stacked: A [L, in, R],
    B [L, R, out]): what `write_row` puts in a row an adapter leaves."""
    shapes = table_shapes(config, 0, max_rank)
    return jax.tree.map(lambda s: np.zeros(s.shape[:1] + s.shape[2:], np.float32), shapes)


def adapter_rows(config, adapters, spec: LoraSpec, max_rank: int):
    """An adapter tree (wedlm_jax.lora.apply / peft.load_peft: float32, layers stacked) as one row of
    every projection's table: rank padded to `max_rank`, B scaled by alpha / rank. A LoraError
    naming the rank when it is above the bound."""
    if spec.rank > max_rank:
        raise LoraError(f"rank {spec.rank} is above the server's LoRA rank bound {max_rank} "
                        "(--max-lora-rank)", "r")
    rows = zero_rows(config, max_rank)
    for name in PROJECTIONS:
        got = adapters.get("layers", {}).get(group_of(name), {}).get(name)
        if got is None:
            continue
        row = rows["layers"][group_of(name)][name]
        a, b = np.asarray(got["kernel_lora_a"], np.float32), np.asarray(got["kernel_lora_b"],
                                                                        np.float32)
        row["lora_a"][:, :, :spec.rank] = a
        row["lora_b"][:, :spec.rank, :] = b * np.float32(spec.scale)
    return rows


def _is_table(path) -> bool:
    return str(getattr(path[-1], "key", path[-1])) in TABLE_LEAVES


def attach(params, table):
    """The params with the table's leaves beside their kernels (a tree shaped like the params:
    layers stacked under "layers", or one tree per layer)."""
    def merge(p, t):
        out = dict(p)
        for k, v in t.items():
            if isinstance(v, dict):
                if k not in out:
                    raise LoraError(f"the adapter table names {k!r}, which the model does not "
                                    "have", k)
                out[k] = merge(out[k], v)
            else:
                out[k] = v
        return out
    return merge(params, table)


def detach(params):
    """(the params without the table's leaves, the table's leaves as nested dicts)."""
    def split(p):
        rest, table = {}, {}
        for k, v in p.items():
            if isinstance(v, dict):
                r, t = split(v)
                rest[k] = r
                if t:
                    table[k] = t
            elif k in TABLE_LEAVES:
                table[k] = v
            else:
                rest[k] = v
        return rest, table
    return split(params)


def has_table(params) -> bool:
    """Whether `params` carry an adapter table."""
    return any(_is_table(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0])


@functools.partial(jax.jit, donate_argnums=(0,))
def write_row(table, row, values):
    """The table (donated) with row `row` (a runtime int32: one program for every row) of every
    leaf replaced by `values` (a tree like the table without the row axis, the third from last)."""
    return jax.tree.map(lambda t, v: jax.lax.dynamic_update_index_in_dim(
        t, v.astype(t.dtype), row, t.ndim - 3), table, values)
