"""Low-rank adapters (LoRA) of the decoder's projections, through qwix's LoRA provider.

    spec = LoraSpec(rank=8, alpha=16, targets=("q", "v"))          # wedlm_jax.lora.spec
    model = lora_model(Transformer(config, dtype=jnp.bfloat16), spec)
    adapters = init_adapters(config, spec, seed=0)                   # A random, B zero
    logits = model.apply({"params": combine(params, adapters, jnp.bfloat16)}, tokens, positions)
    merged = fold(params, adapters, spec)                            # W + (alpha/r) A @ B

`qwix.apply_lora_to_model` intercepts each targeted projection's matmul and adds
`(alpha / rank) * x @ A @ B` to it; its adapter parameters sit beside the projection's kernel in
the same tree: `kernel_lora_a` [L, in, rank] and `kernel_lora_b` [L, rank, out] under
`layers/attn/q_proj` and so on (stacked like every layer parameter; `in` / `out` are the kernel's
input / output axes flattened: q_proj's A is [L, embed, r], its B [L, r, heads * head_dim]).
That is PEFT's lora_A / lora_B of the layer, transposed (wedlm_jax/lora/peft.py).

The projections call `jnp.einsum`; qwix's LoRA einsum records a debugging attribute on the module,
which a linen module refuses outside setup, so `Provider` routes a projection's contraction
through qwix's LoRA `dot_general` instead (the same product, the same adapter shapes).

A quantized kernel (a `qwix.QArray` of wedlm_jax/quantize.py: QLoRA, the frozen base int8 / int4)
is read by `quantize.projection_einsum`, whose inner einsum takes the kernel's integer values,
not a parameter qwix would recognise, and scales the product after it. `Provider` therefore
intercepts `projection_einsum` itself: a float kernel goes through the LoRA einsum as before; a
quantized one through `projection_einsum` as decoding reads it, plus the adapters' term
`(alpha / rank) * dropout(x) @ A @ B` (`low_rank`) in the compute dtype. The adapters of a
quantized base are given (`combine`), never created by the forward: they are float, of the
kernel's float shape (`adapter_shapes`).

An adapter tree holds only the adapter leaves (nested dicts like the params); the base is kept
apart (frozen in training, not in the optimizer). The adapters enter a forward in the compute
dtype (`combine`): the layer scan's carry keeps one dtype.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix

from wedlm_jax import quantize
from wedlm_jax.config import ModelConfig
from wedlm_jax.lora.spec import LoraError, LoraSpec

SUFFIXES = ("kernel_lora_a", "kernel_lora_b")


class Provider(qwix.LoraProvider):
    """qwix's LoRA provider, a projection's einsum ("...ab,abc->...c": the input's trailing axes
    against the kernel's leading ones) taken through its LoRA dot_general, and a projection's
    quantized kernel given its adapters' term (`projection_einsum`)."""

    def get_intercept_map(self):
        return super().get_intercept_map() | {
            "wedlm_jax.quantize.projection_einsum": self.projection_einsum}

    def projection_einsum(self, spec: str, x, kernel, dtype, form: str = "einsum"):
        """`quantize.projection_einsum` with the adapters of the current projection when the rule
        targets it: a float kernel through the LoRA einsum, a quantized one read as decoding
        reads it (inside an intercepted call, nothing is intercepted again) plus `low_rank`."""
        x = x.astype(dtype)
        if not isinstance(kernel, qwix.QArray):
            return self.einsum(spec, x, kernel.astype(dtype))
        y = quantize.projection_einsum(spec, x, kernel, dtype, form)
        rule = self._get_current_rule_and_op_id("einsum", only_rule=True)[0]
        if not isinstance(rule, qwix.LoraRule):
            return y
        n_out = len(spec.split("->")[1].lstrip("."))
        return y + low_rank(x, kernel.qvalue.ndim - n_out, y.shape[y.ndim - n_out:], rule, dtype)

    def einsum(self, einsum_str, *operands, **kwargs):
        if len(operands) == 2 and einsum_str.startswith("...") and not kwargs:
            lhs_spec, rest = einsum_str[3:].split(",", 1)
            rhs_spec = rest.split("->")[0]
            if lhs_spec and rhs_spec.startswith(lhs_spec):
                x, w = operands
                n = len(lhs_spec)
                dims = ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
                return self.dot_general(x, w, dims)
        return super().einsum(einsum_str, *operands, **kwargs)


def low_rank(x, n_in: int, out_shape: tuple, rule, dtype):
    """The adapters' term of the current projection (a linen module holding `kernel_lora_a`
    [in, rank] and `kernel_lora_b` [rank, out] beside its kernel): x [..., *ins] (its `n_in`
    trailing axes the kernel's inputs) as (alpha / rank) * dropout(x) @ A @ B [..., *out_shape]
    in `dtype`, dropout from the module's "dropout" rng stream."""
    module = nn.module._context.module_stack[-1]  # flax's current module (what qwix reads too)
    a = module.get_variable("params", SUFFIXES[0])
    b = module.get_variable("params", SUFFIXES[1])
    if a is None or b is None:
        raise LoraError(f"{'/'.join(module.path)}: a quantized kernel takes its adapters given "
                        f"(combine); the forward does not create them")
    if rule.dropout > 0:
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rule.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - rule.dropout), 0).astype(dtype)
    lead = x.shape[:x.ndim - n_in]
    h = jnp.einsum("...i,ir->...r", x.reshape(lead + (-1,)), nn.meta.unbox(a).astype(dtype))
    y = jnp.einsum("...r,ro->...o", h, nn.meta.unbox(b).astype(dtype))
    return y.reshape(lead + tuple(out_shape)) * jnp.asarray(rule.alpha / rule.rank, dtype)


def module_regex(targets) -> str:
    """qwix's module-path rule for the projections `targets` (under any layer)."""
    return r".*/(" + "|".join(targets) + r")"


def lora_model(model: nn.Module, spec: LoraSpec, dropout: float | None = None) -> nn.Module:
    """`model` (a `Transformer`) with `spec`'s adapters on its targeted projections. `dropout`
    overrides the spec's (0 for evaluation and decoding); with dropout, `apply` needs
    `rngs={"dropout": key}`."""
    rate = spec.dropout if dropout is None else dropout
    provider = Provider(module_path=module_regex(spec.targets), rank=spec.rank,
                        alpha=float(spec.alpha), dropout=float(rate))
    return qwix.apply_lora_to_model(model, provider)


def _is_adapter(path) -> bool:
    return str(getattr(path[-1], "key", path[-1])) in SUFFIXES


def _select(tree):
    """The adapter leaves of a params-shaped tree, as nested dicts."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_adapter(path):
            node = out
            for k in path[:-1]:
                node = node.setdefault(k.key, {})
            node[path[-1].key] = leaf
    return out


def _boxed(config: ModelConfig, spec: LoraSpec):
    from wedlm_jax.model import Transformer
    model = lora_model(Transformer(config), spec, dropout=0.0)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))["params"]


def adapter_shapes(config: ModelConfig, spec: LoraSpec):
    """The adapter tree of `spec` on `config` as float32 ShapeDtypeStructs (no allocation)."""
    return _select(nn.meta.unbox(_boxed(config, spec)))


def adapter_logical_axes(config: ModelConfig, spec: LoraSpec):
    """The adapter tree's logical-axis tuples (qwix's: each from its kernel's first axis of the
    side it keeps, e.g. q_proj's A ('layers', 'embed', None), B ('layers', None, 'heads'))."""
    specs = nn.get_partition_spec(_boxed(config, spec))
    axes = jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return _select_axes(axes)


def _select_axes(tree):
    out: dict = {}

    def walk(node, into):
        for k, v in node.items():
            if isinstance(v, dict):
                sub = walk(v, {})
                if sub:
                    into[k] = sub
            elif k in SUFFIXES:
                into[k] = v
        return into
    return walk(tree, out)


def init_adapters(config: ModelConfig, spec: LoraSpec, seed: int = 0):
    """Fresh float32 adapters (NumPy, host): every A He-uniform over its layer's input
    (qwix's default, bound sqrt(6 / in)), every B zero, so the adapted model starts as the base."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        if str(path[-1].key) == "kernel_lora_b":
            return np.zeros(s.shape, np.float32)
        bound = np.sqrt(6.0 / s.shape[-2])
        return rng.uniform(-bound, bound, s.shape).astype(np.float32)
    return jax.tree_util.tree_map_with_path(leaf, adapter_shapes(config, spec))


def combine(params, adapters, dtype=None):
    """The params with the adapter leaves beside their kernels (cast to `dtype` when given)."""
    def merge(p, a):
        out = dict(p)
        for k, v in a.items():
            if isinstance(v, dict):
                if k not in out:
                    raise LoraError(f"the adapter names {k!r}, which the model does not have", k)
                out[k] = merge(out[k], v)
            else:
                out[k] = v.astype(dtype) if dtype is not None else v
        return out
    return merge(params, adapters)


def adapter_targets(adapters) -> tuple[str, ...]:
    """The projection names an adapter tree adapts."""
    names = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]:
        names.add(str(path[-2].key))
    return tuple(sorted(names))


def fold(params, adapters, spec: LoraSpec):
    """Float params with the adapters merged in: each targeted kernel W [L, *ins, *outs] becomes
    W + (alpha / rank) * (A @ B) reshaped to it (layers stacked, float kernels)."""
    def merge(p, a):
        out = dict(p)
        for k, v in a.items():
            if "kernel_lora_a" in v:
                w = p[k]["kernel"]
                if not isinstance(w, (jax.Array, np.ndarray)):
                    raise LoraError(f"{k}: merging needs float weights (merge before quantizing)")
                delta = jnp.einsum("lir,lro->lio", jnp.asarray(v["kernel_lora_a"], jnp.float32),
                                   jnp.asarray(v["kernel_lora_b"], jnp.float32))
                merged = w.astype(jnp.float32) + spec.scale * delta.reshape(w.shape)
                out[k] = dict(p[k], kernel=merged.astype(w.dtype))
            else:
                out[k] = merge(p[k], v)
        return out
    if "layers" not in params:
        raise LoraError("merging needs the layers stacked (fold before model.unstack_layers)")
    return merge(params, adapters)
