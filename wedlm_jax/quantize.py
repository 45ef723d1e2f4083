"""Weight-only quantization of the decoder's projections, on qwix (google/qwix) `QArray`s.

    qparams = quantize_params(params, "int8")            # per output channel
    qparams = quantize_params(params, "int4", group=64)  # groups of 64 along the input
    logits = Transformer(config).apply({"params": qparams}, tokens, positions)

Schemes (`SCHEMES`): "int8" keeps one scale per output channel (per layer, per output element:
the input axes share it; `group` > 0 makes it grouped too); "int4" keeps one scale per `group`
consecutive elements of each projection's last input axis (default `DEFAULT_GROUP["int4"]` = 64,
MLX's default; the other input axes, o_proj's heads, get their own scales). Symmetric absmax
scales in the weights' dtype. The seven projections of every layer (q/k/v/o, gate/up/down) are
quantized under the scheme; the vocabulary tables (the embedding and the LM head, `TABLES`) are
int8 with one scale per vocabulary entry under every scheme (the LM head is read whole at every
step, a large share of its bytes; at 4 bits it would cost more accuracy than the projections, as
llama.cpp's 4-bit mixes keep their output tensor at 6-8 bits: docs/quantization.md); the norms
stay in the weights' dtype.

A quantized kernel is a `qwix.QArray` (int8 / int4 values, the scales beside them) in place of the
float kernel in the same tree, so the layer scan slices it like any parameter, one tree per layer
(`model.unstack_layers`) splits it, and the model's projections read it through
`projection_einsum` in the platform's matmul form (`FORMS`, `matmul_form`): weight-only, a
per-channel kernel's integer values enter the matmul cast to the compute dtype and its scales
multiply the output (in the projection's own einsum on TPU and CPU; as one 2-D gemm on GPU, whose
compiler fuses that cast: the step reads int8 / int4 bytes); a grouped kernel goes through the
Pallas kernels of `wedlm_jax.grouped_matmul` on one GPU or TPU (neither compiler fuses a
sub-channel dequantization) and is dequantized into its matmul (`qwix.dequantize`) elsewhere, one
layer's kernel at a time; nothing dequantizes a whole stacked weight.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix

from wedlm_jax import grouped_matmul as grouped_lib
from wedlm_jax.quantize_scheme import QuantizeError, resolve_group

QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
# the projections quantized, with the number of input (contracted) axes their kernel leads with
PROJECTIONS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2,
               "gate_proj": 1, "up_proj": 1, "down_proj": 1}
# the vocabulary tables, each with its vocabulary axis (one scale per entry), and their qtype
TABLES = {"embedding": 0, "lm_head": 1}
TABLE_QTYPE = jnp.int8


def quantize_kernel(w, scheme: str, n_in: int, group: int = 0, lead: int = 0):
    """`w` [*lead axes, *n_in input axes, *output axes] as a QArray: one scale per lead index
    (the stacked layers) and output element; per `group` elements of the last input axis and per
    index of the other input axes when `group` > 0, else shared by every input axis."""
    ins = list(range(lead, lead + n_in))
    outs = list(range(lead + n_in, w.ndim))
    channels = list(range(lead)) + outs + (ins[:-1] if group else [])
    tiles = {ins[-1]: group} if group else {}
    q = qwix.quantize(w.astype(jnp.float32), QTYPES[scheme], channelwise_axes=channels,
                      tiled_axes=tiles)
    return q.replace(scale=q.scale.astype(w.dtype))


def quantize_table(w, axis: int):
    """A vocabulary table (`TABLES`) as an int8 QArray, one scale per entry along `axis`."""
    q = qwix.quantize(w.astype(jnp.float32), TABLE_QTYPE, channelwise_axes=[axis])
    return q.replace(scale=q.scale.astype(w.dtype))


def quantize_param(w, names: tuple, scheme: str, group: int = 0, lead: int = 0):
    """The parameter at the path `names` as `quantize_params` holds it under (scheme, group): a
    projection kernel by `quantize_kernel`, a vocabulary table by `quantize_table`, anything
    else (and everything under "none") as it is."""
    if scheme == "none":
        return w
    if (axis := table_axis(names)) is not None:
        return quantize_table(w, axis)
    n_in = projection_inputs(names)
    return w if n_in is None else quantize_kernel(w, scheme, n_in, group, lead)


def table_axis(names) -> int | None:
    """The vocabulary axis of the table at the path `names` (("embedding",)), else None."""
    names = tuple(names)
    return TABLES[names[0]] if len(names) == 1 and names[0] in TABLES else None


def is_quantized_param(names) -> bool:
    """Whether a scheme quantizes the parameter at the path `names`."""
    return table_axis(names) is not None or projection_inputs(names) is not None


def projection_inputs(names) -> int | None:
    """The number of input axes of the kernel at the parameter path `names` (("layers", "attn",
    "q_proj", "kernel")) when it is a projection's, else None."""
    names = tuple(names)
    if len(names) >= 2 and names[-1] == "kernel" and names[-2] in PROJECTIONS:
        return PROJECTIONS[names[-2]]
    return None


def _names(path) -> tuple:
    """The parameter names of a jax key path."""
    return tuple(getattr(k, "key", None) for k in path)


def _kernel_inputs(path) -> int | None:
    """`projection_inputs` of a jax key path."""
    return projection_inputs(_names(path))


def _lead(path) -> int:
    """The leading (stacked layer) axes of the kernel at `path`."""
    return 1 if any(getattr(k, "key", None) == "layers" for k in path) else 0


def is_quantized(params) -> bool:
    """Whether any leaf of `params` is a QArray."""
    return any(isinstance(x, qwix.QArray)
               for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, qwix.QArray)))


def quantize_params(params, scheme: str, group: int | None = None, *, free: bool = False):
    """`params` (layers stacked or one tree per layer; arrays or ShapeDtypeStructs) with every
    projection kernel quantized under `scheme` (see the module docstring); "none" returns them
    as they are. Each kernel is quantized by one jitted call (compiled once per shape); `free`:
    each float kernel's buffer is deleted once quantized (weights just loaded: the float tree
    and the quantized one are never both whole on the device)."""
    group = resolve_group(scheme, group)
    if scheme == "none":
        return params
    if is_quantized(params):
        raise QuantizeError("these weights are quantized already", "quantize")
    leaves = jax.tree.leaves(params)
    if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return jax.eval_shape(lambda p: quantize_params(p, scheme, group), params)

    def leaf(path, w):
        if not is_quantized_param(_names(path)):
            return w
        out = quantize_tensor(w, _names(path), scheme, group, _lead(path))
        if free and isinstance(w, jax.Array):
            jax.block_until_ready(out)
            w.delete()
        return out
    return jax.tree_util.tree_map_with_path(leaf, params)


_quantize_jit = jax.jit(quantize_param, static_argnums=(1, 2, 3, 4))


def quantize_tensor(w, names: tuple, scheme: str, group: int = 0, lead: int = 0):
    """`quantize_param` compiled once per shape (what `quantize_params` runs per parameter)."""
    return _quantize_jit(w, tuple(names), scheme, group, lead)


def expected(params, scheme: str, group: int):
    """The abstract tree (shapes, dtypes) the weights have once quantized under (scheme, group),
    from float weights or from quantized ones (their float shapes rebuilt)."""
    def floats(x):
        if isinstance(x, qwix.QArray):
            return jax.ShapeDtypeStruct(x.qvalue.shape, x.scale.dtype)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    shapes = jax.tree.map(floats, params, is_leaf=lambda x: isinstance(x, qwix.QArray))
    return quantize_params(shapes, scheme, group)


def _same_shapes(a, b) -> bool:
    """Whether two trees have one structure and the same shapes and dtypes leaf by leaf."""
    abstract = lambda t: jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), t)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and jax.tree.leaves(abstract(a)) == jax.tree.leaves(abstract(b)))


def conform(params, scheme: str, group: int):
    """`params` as a decoder under (scheme, group) takes them: float weights are quantized, weights
    quantized so already pass; weights quantized otherwise raise QuantizeError naming both."""
    if not is_quantized(params):
        return quantize_params(params, scheme, group)
    if not _same_shapes(expected(params, scheme, group), params):
        raise QuantizeError(f"the weights are quantized {describe_params(params)}, not "
                            f"{describe(scheme, group)}: decode them with that quantize setting",
                            "quantize")
    return params


def scheme_of(params) -> tuple[str, int]:
    """(scheme, group) that quantized `params` (("none", 0) for float weights): the qtype of its
    kernels and the group size whose shapes they have."""
    if not is_quantized(params):
        return "none", 0
    scheme = describe_params(params)
    if scheme not in QTYPES:
        raise QuantizeError(f"the weights mix quantizations ({scheme})", "quantize")
    groups = {0}
    for path, q in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, qwix.QArray))[0]:
        n_in = _kernel_inputs(path)
        if isinstance(q, qwix.QArray) and n_in is not None:
            ax = _lead(path) + n_in - 1
            groups.add(q.qvalue.shape[ax] // q.scale.shape[ax])
    for group in sorted(groups):
        if _same_shapes(expected(params, scheme, group), params):
            return scheme, group
    raise QuantizeError(f"the {scheme} weights' scales fit no group size", "quantize")


def describe(scheme: str, group: int) -> str:
    """'int4 (groups of 64)', 'int8 (per output channel)', 'none'."""
    if scheme == "none":
        return "none"
    return f"{scheme} ({f'groups of {group}' if group else 'per output channel'})"


def describe_params(params) -> str:
    """The qtype(s) of a quantized tree's projection kernels, e.g. 'int8' (the vocabulary
    tables are int8 under every scheme)."""
    kinds = {jnp.dtype(x.qtype).name for path, x in jax.tree_util.tree_flatten_with_path(
                 params, is_leaf=lambda x: isinstance(x, qwix.QArray))[0]
             if isinstance(x, qwix.QArray) and _kernel_inputs(path) is not None}
    return "/".join(sorted(kinds)) or "none"


def logical_axes(axes_tree, params):
    """The logical-axes tree of the params (`model.param_logical_axes`) matched to quantized
    `params`: a quantized kernel's values and scales carry its axes (a scale's size-1 axes are
    left whole by `sharding.spec_for`)."""
    def match(axes, p):
        if isinstance(p, qwix.QArray):
            return p.replace(qvalue=axes, scale=axes)
        return axes
    return jax.tree.map(match, axes_tree, params,
                        is_leaf=lambda x: isinstance(x, tuple) or isinstance(x, qwix.QArray))


def projection_einsum(spec: str, x, kernel, dtype, form: str = "einsum"):
    """`einsum(spec, x, kernel)` in the compute `dtype` ("...{ins},{ins}{outs}->...{outs}"), a
    quantized kernel read in the matmul `form` (FORMS, `matmul_form`), weight-only:
    - a per-channel kernel (one scale per output element, shared by every input axis) enters
      the matmul as its integer values cast to `dtype`, the scales applied to the output: in
      the projection's own einsum ("einsum", "mosaic": libtpu reads each layer's int8 / int4
      kernel in place), or as one 2-D gemm of its axes flattened ("gemm2d", "triton":
      XLA:GPU fuses the cast of a 2-D operand into its gemm; on a TPU the flattening is a
      relayout copy of the kernel at every step). A dequantized kernel (values x scales, a
      multiply XLA:GPU does not fuse) would be written out and read again at the float size.
    - a grouped kernel is read by a `wedlm_jax.grouped_matmul` kernel ("triton", "mosaic" and
      their interpret forms, where its shapes tile, for up to its MAX_ROWS rows: a decode
      step's), else dequantized into the matmul (`qwix.dequantize`).
    qwix's own weight-only path (`qwix.einsum`) ran a projection several times slower than these
    on XLA:CPU (BENCHMARKS.md section 11)."""
    x = x.astype(dtype)
    if not isinstance(kernel, qwix.QArray):
        return jnp.einsum(spec, x, kernel.astype(dtype))
    n_out = len(spec.split("->")[1].lstrip("."))
    n_in = kernel.qvalue.ndim - n_out
    if all(d == 1 for d in kernel.scale.shape[:n_in]):
        if form in ("einsum", "mosaic", "mosaic-interpret"):
            y = jnp.einsum(spec, x, kernel.qvalue.astype(dtype))
            return y * kernel.scale.reshape(kernel.scale.shape[n_in:]).astype(dtype)
        return _channel_matmul(x, kernel, n_in, dtype)
    if form not in ("einsum", "gemm2d"):
        y = _grouped_kernel_matmul(x, kernel, n_in, form)
        if y is not None:
            return y
    return jnp.einsum(spec, x, qwix.dequantize(kernel.astype(dtype)))


# how a projection's quantized kernel enters its matmul (`projection_einsum`): per-channel
# kernels in the projection's einsum or as a 2-D gemm, grouped ones dequantized into it; or
# grouped ones through a Pallas kernel (wedlm_jax.grouped_matmul: triton on GPU, the per-channel
# ones as 2-D gemms there; mosaic on TPU), "-interpret" in its CPU-checkable form
FORMS = ("einsum", "gemm2d", "triton", "mosaic", "triton-interpret", "mosaic-interpret")


def matmul_form(platform: str, grouped_matmul: str = "xla", interpret: bool = False) -> str:
    """The FORMS entry for a model on `platform` whose grouped kernels are read by
    `grouped_matmul` ("xla" | "pallas", `grouped_lib.CHOICES`); `interpret`: the Pallas kernel
    in its CPU-checkable form (the Triton one off GPU and TPU)."""
    if grouped_matmul not in grouped_lib.CHOICES:
        raise ValueError(f"grouped_matmul {grouped_matmul!r} is unknown; allowed: "
                         f"{', '.join(grouped_lib.CHOICES)}")
    if grouped_matmul == "pallas":
        kernel = ("triton" if interpret and platform not in ("gpu", "cuda", "rocm", "tpu")
                  else grouped_lib.kernel_for(platform))
        return f"{kernel}-interpret" if interpret else kernel
    return "gemm2d" if platform in ("gpu", "cuda", "rocm") else "einsum"


def embed(table, tokens, dtype):
    """The rows of the embedding table at `tokens`, in `dtype`; an int8 table's rows scaled."""
    if not isinstance(table, qwix.QArray):
        return jnp.take(table, tokens, axis=0).astype(dtype)
    rows = jnp.take(table.qvalue, tokens, axis=0).astype(dtype)
    return rows * jnp.take(table.scale, tokens, axis=0).astype(dtype)


def transpose_table(table):
    """A tied embedding [V, E] as the LM head [E, V] (an int8 table's scales transposed too)."""
    if isinstance(table, qwix.QArray):
        return table.replace(qvalue=table.qvalue.T, scale=table.scale.T)
    return table.T


def head_matmul(x, head, dtype):
    """Float32 logits of hidden states [B, S, E] through the head [E, V]: the matmul in `dtype`
    accumulated in float32; an int8 head's values enter it cast to `dtype`, its per-entry scales
    applied to the float32 logits (the step reads the int8 table)."""
    spec = "bse,ev->bsv"
    if not isinstance(head, qwix.QArray):
        return jnp.einsum(spec, x, head.astype(dtype), preferred_element_type=jnp.float32)
    logits = jnp.einsum(spec, x, head.qvalue.astype(dtype), preferred_element_type=jnp.float32)
    return logits * head.scale.reshape(-1).astype(jnp.float32)


def _channel_matmul(x, kernel, n_in: int, dtype):
    """x [..., *ins] against a per-channel quantized kernel [*ins, *outs] as one 2-D matmul of
    its values cast to `dtype` ([prod ins, prod outs]: XLA:GPU fuses the cast of a 2-D operand,
    int4 included, into its gemm), then the scales over the output."""
    shape = kernel.qvalue.shape
    ins, outs = math.prod(shape[:n_in]), shape[n_in:]
    lead = x.shape[:x.ndim - n_in]
    w = kernel.qvalue.reshape(ins, math.prod(outs)).astype(dtype)
    y = jnp.einsum("...i,io->...o", x.reshape(lead + (ins,)), w)
    return y.reshape(lead + outs) * kernel.scale.reshape(outs).astype(dtype)


def _grouped_kernel_matmul(x, kernel, n_in: int, form: str):
    """x [..., *ins] against a grouped kernel [*ins, *outs] (scales [*ins / group on the last,
    *outs]) as `grouped_matmul.grouped_matmul` of the 2-D [prod ins, prod outs] values: the
    flattened input axis keeps each group's rows consecutive (the Mosaic kernel takes q / k / v's
    [hidden, heads, head_dim] values as they are: flattening them is a relayout copy on a TPU).
    None where its shapes don't tile or x has more rows than the kernel takes
    (`grouped_matmul.MAX_ROWS`, per kernel)."""
    shape, sshape = kernel.qvalue.shape, kernel.scale.shape
    ins, outs = math.prod(shape[:n_in]), shape[n_in:]
    group = shape[n_in - 1] // sshape[n_in - 1]
    lead = x.shape[:x.ndim - n_in]
    which = form.split("-")[0]
    if math.prod(lead) > grouped_lib.MAX_ROWS[which]:
        return None
    x2 = x.reshape(math.prod(lead), ins)
    interpret = form.endswith("-interpret")
    if which == "mosaic" and n_in == 1 and len(outs) == 2 and \
            grouped_lib.mosaic_heads(ins, *outs, group):      # q / k / v read as laid out
        y = grouped_lib.grouped_matmul(x2, kernel.qvalue, kernel.scale, group=group,
                                       kernel=which, interpret=interpret)
        return y.reshape(lead + outs)
    if not grouped_lib.supported(ins, math.prod(outs), group, which):
        return None
    y = grouped_lib.grouped_matmul(
        x2, kernel.qvalue.reshape(ins, math.prod(outs)),
        kernel.scale.reshape(ins // group, math.prod(outs)), group=group, kernel=which,
        interpret=interpret)
    return y.reshape(lead + outs)


def weight_bytes(params) -> int:
    """Bytes of `params` as stored (int4 values counted at half a byte)."""
    def size(x):
        bits = 4 if jnp.dtype(x.dtype) == jnp.int4 else 8 * jnp.dtype(x.dtype).itemsize
        return math.prod(x.shape) * bits // 8
    return sum(size(x) for x in jax.tree.leaves(params))
