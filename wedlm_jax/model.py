"""The Qwen2 / Qwen3 / Llama decoder in flax.linen, pure functional.

    model = Transformer(config)
    logits = model.apply({'params': params}, tokens, positions)                      # (a) causal
    logits = model.apply({'params': params}, tokens, positions, segment_ids=seg)     # (a) packed
    logits = model.apply({'params': params}, tokens, positions, mask=mask)           # (b) explicit
    logits, cache = model.apply({'params': params}, tokens, positions,
                                kv_cache=cache, cache_len=cache_len)                 # (c) cache

Training arrangements pass their structure: `model.apply(..., structure=arrangement,
objective="dual")` (dense: `masking.structure_mask`). `Transformer(attention=...)` picks the
implementation (dense | tiled | splash | cudnn | pallas | auto, see `attention.backends`; dense is
the default); non-dense paths get one shared `AttentionContext` (e.g. the tile plan) per forward.

Cache mode (c): the query at physical index j of the forward attends cache rows 0..n-1 and the
forward's own rows n..n+j (its K/V are written at rows n + physical index first; n = cache_len[b]).
Whatever `attention` resolves to, it runs `attention.cache.attend_cache` (dense reference, tiled:
the live tiles of `kv_tile` rows, pallas, cudnn); `kv_tile` is a model setting, e.g.
`Transformer(config, dtype=jnp.bfloat16, attention="tiled", kv_tile=256)`.

RoPE uses the given logical `positions`; causality follows physical order. Nothing here knows
about diffusion: reordering, streams and masks are arrangements of these inputs.

The decoder layers are one `nn.scan` over `Block` (`layer_stack`), with the remat policy
`Transformer.remat` (full | save_dots | none): XLA compiles one layer and runs (and, under FSDP,
gathers) one layer at a time.

Parameter layout: every layer parameter is stacked under `layers` with a leading 'layers' axis
[num_layers, ...]: q_proj [L, embed, heads, head_dim], k_proj/v_proj [L, embed, kv_heads,
head_dim], o_proj [L, heads, head_dim, embed], gate/up [L, embed, mlp], down [L, mlp, embed],
norms [L, dim]; every parameter carries logical axis names (see `axis_rules.AxisRules`).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from wedlm_jax.attention import core as attn_lib
from wedlm_jax.attention import backends as attn_backends
from wedlm_jax import masking
from wedlm_jax.attention import kv_quant
from wedlm_jax.lora import table as lora_table
from wedlm_jax.attention import paged
from wedlm_jax import quantize
from wedlm_jax.attention import tiled as tiled_lib
from wedlm_jax.config import ModelConfig
from wedlm_jax.rope import apply_rope, rope_cos_sin, rope_frequencies

Dtype = Any
KVCache = dict  # {'k', 'v'}: [layers, B, S_max, KVH, D] each (init_kv_cache)

_INIT = nn.initializers.normal(0.02)


def _param(mod: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str | None],
           init=_INIT, dtype=jnp.float32):
    return mod.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def _constrain(x, axes):
    return nn.with_logical_constraint(x, axes)


class RMSNorm(nn.Module):
    eps: float
    axis_name: str = "norm"
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", (x.shape[-1],), (self.axis_name,), nn.initializers.ones,
                       self.param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * xf.astype(x.dtype)


class Projection(nn.Module):
    """A dense layer over the trailing `len(in_axes)` dims with named output dims."""
    in_axes: tuple
    out_axes: tuple
    out_shape: tuple
    use_bias: bool
    dtype: Dtype
    param_dtype: Dtype
    quant_form: str = "einsum"   # how a quantized kernel enters the matmul (quantize.FORMS)

    @nn.compact
    def __call__(self, x, lora_index=None):
        n_in = len(self.in_axes)
        in_shape = x.shape[-n_in:]
        kernel = _param(self, "kernel", in_shape + self.out_shape, self.in_axes + self.out_axes,
                        dtype=self.param_dtype)
        letters = "abcdefgh"
        ins, outs = letters[:n_in], letters[n_in:n_in + len(self.out_shape)]
        # a quantized kernel (wedlm_jax.quantize) is a qwix QArray
        y = quantize.projection_einsum(f"...{ins},{ins}{outs}->...{outs}", x, kernel, self.dtype,
                                       self.quant_form)
        if self.use_bias:
            bias = _param(self, "bias", self.out_shape, self.out_axes, nn.initializers.zeros,
                          self.param_dtype)
            y = y + bias.astype(self.dtype)
        if lora_index is not None and self.has_variable("params", "lora_a"):   # lora_table
            y = y + lora_table.low_rank(x, self.get_variable("params", "lora_a"),
                                        self.get_variable("params", "lora_b"), lora_index, n_in,
                                        self.out_shape, self.dtype)
        return y


class Attention(nn.Module):
    config: ModelConfig
    dtype: Dtype
    param_dtype: Dtype
    quant_form: str = "einsum"

    @nn.compact
    def __call__(self, x, cos, sin, mask, kv_cache=None, cache_len=None, layer=None,
                 lora_index=None):
        """kv_cache: the stacked cache {'k', 'v'} [L, B, R, KVH, D] and `layer` this layer's index
        in it (cache mode): the new K/V are written at rows cache_len[b].. of that layer in place,
        and attention reads that layer's live tiles from the stacked buffer."""
        c = self.config
        proj = lambda name, out_axes, out_shape, bias, in_axes=("embed",): Projection(
            in_axes, out_axes, out_shape, bias, self.dtype, self.param_dtype, self.quant_form,
            name=name)
        q = proj("q_proj", ("heads", "head_dim"), (c.num_heads, c.head_dim), c.qkv_bias)(
            x, lora_index)
        k = proj("k_proj", ("kv_heads", "head_dim"), (c.num_kv_heads, c.head_dim), c.qkv_bias)(
            x, lora_index)
        v = proj("v_proj", ("kv_heads", "head_dim"), (c.num_kv_heads, c.head_dim), c.qkv_bias)(
            x, lora_index)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, "head_dim", self.param_dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, "head_dim", self.param_dtype, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_cache = None
        if kv_cache is not None and paged.is_paged(kv_cache):   # paged cache mode (PagedContext)
            out, new_cache = paged.layer_step(q, k, v, kv_cache, cache_len, layer, c.num_layers,
                                              impl=mask.impl, scale=c.head_dim ** -0.5,
                                              pages_per_tile=mask.pages_per_tile,
                                              interpret=mask.interpret)
        elif kv_cache is not None:   # cache mode: always through an AttentionContext
            ck = attn_lib.cache_write(kv_cache["k"], k, cache_len, layer)
            cv = attn_lib.cache_write(kv_cache["v"], v, cache_len, layer)
            new_cache = {"k": ck, "v": cv}
            # the stacked buffers themselves, read at this layer (the tiled path reads its live
            # tiles in place; no per-layer copy of the cache is made)
            out = attn_backends.apply(mask, q, ck, cv, c.head_dim ** -0.5, layer=layer)
        elif isinstance(mask, attn_backends.AttentionContext):
            out = attn_backends.apply(mask, q, k, v, c.head_dim ** -0.5)
        else:
            out = attn_lib.attend(q, k, v, mask, c.head_dim ** -0.5)
        out = _constrain(out, ("batch", "length", "heads", "head_dim"))
        y = proj("o_proj", ("embed",), (c.hidden_size,), c.o_bias, ("heads", "head_dim"))(
            out, lora_index)
        return y, new_cache


class MLP(nn.Module):
    config: ModelConfig
    dtype: Dtype
    param_dtype: Dtype
    quant_form: str = "einsum"

    @nn.compact
    def __call__(self, x, lora_index=None):
        c = self.config
        dense = lambda name, i, o, n: Projection((i,), (o,), (n,), c.mlp_bias, self.dtype,
                                                 self.param_dtype, self.quant_form, name=name)
        gate = dense("gate_proj", "embed", "mlp", c.intermediate_size)(x, lora_index)
        up = dense("up_proj", "embed", "mlp", c.intermediate_size)(x, lora_index)
        h = _constrain(nn.silu(gate) * up, ("batch", "length", "mlp"))
        return dense("down_proj", "mlp", "embed", c.hidden_size)(h, lora_index)


class Block(nn.Module):
    """One decoder layer; the scan body of `Transformer`. The carry is (x, kv_cache, layer): the
    activations, the whole stacked cache (None outside cache mode) and this layer's index, so the
    cache is updated in place at its layer instead of being sliced in and stacked out."""
    config: ModelConfig
    dtype: Dtype
    param_dtype: Dtype
    quant_form: str = "einsum"

    @nn.compact
    def __call__(self, carry, cos, sin, mask, cache_len=None, lora_index=None):
        x, kv_cache, layer = carry
        c = self.config
        h = RMSNorm(c.rms_norm_eps, "norm", self.param_dtype, name="input_norm")(x)
        h, new_cache = Attention(c, self.dtype, self.param_dtype, self.quant_form, name="attn")(
            h, cos, sin, mask, kv_cache, cache_len, layer, lora_index)
        x = x + h
        h = RMSNorm(c.rms_norm_eps, "norm", self.param_dtype, name="post_attn_norm")(x)
        x = x + MLP(c, self.dtype, self.param_dtype, self.quant_form, name="mlp")(h, lora_index)
        return (_constrain(x, ("batch", "length", "embed")), new_cache, layer + 1), None


# Remat policies of the layer scan: what the backward pass keeps of each layer's forward.
# full: only the layer's input (everything else recomputed); save_dots: also the outputs of the
# matmuls without batch dimensions (the projections; attention scores are recomputed); none: all.
REMAT_POLICIES = ("full", "save_dots", "none")


def remat_policy(name) -> str:
    """The canonical remat policy name (`True`/`False` are the old switch: full / none); a
    ValueError naming the allowed values otherwise."""
    if isinstance(name, bool):
        return "full" if name else "none"
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat policy {name!r} does not exist; allowed: "
                         f"{', '.join(REMAT_POLICIES)}")
    return name


def _block(remat):
    """`Block`, rematerialised under the policy `remat` (REMAT_POLICIES)."""
    policy = remat_policy(remat)
    if policy == "none":
        return Block
    saveable = None if policy == "full" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return nn.remat(Block, policy=saveable, prevent_cse=False)


def layer_stack(config: ModelConfig, dtype, param_dtype, remat="none",
                name: str = "layers", unroll: int = 1, quant_form: str = "einsum") -> nn.Module:
    """The decoder layers as one `nn.scan` over `Block`: parameters stacked on a leading
    'layers' axis, so XLA runs (and FSDP gathers) one layer at a time. `unroll` layers per loop
    iteration (ahead-of-time cost analysis unrolls all: XLA counts a loop body once)."""
    stack = nn.scan(_block(remat), variable_axes={"params": 0},
                    split_rngs={"params": True, "dropout": True},   # (LoRA's dropout: per layer)
                    in_axes=(nn.broadcast,) * 5,
                    length=config.num_layers, unroll=unroll,
                    metadata_params={nn.PARTITION_NAME: "layers"})
    return stack(config, dtype, param_dtype, quant_form, name=name)


class Transformer(nn.Module):
    """Decoder-only LM. `dtype` is the compute dtype, `param_dtype` the storage dtype; scores,
    softmax and logits are float32. `remat` is the layer scan's remat policy (`REMAT_POLICIES`;
    True / False mean full / none)."""
    config: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat: bool | str = "none"
    attention: str = "dense"          # dense | tiled | splash | cudnn | pallas | auto (backends)
    attention_tile: int = 128         # tile size of the tiled path
    attention_block_size: int = 32    # the dual-stream block size (splash mask template)
    kv_tile: int = 256                # cache mode: KV rows per tile (tiled, pallas)
    attention_interpret: bool = False  # accelerator kernels in CPU-checkable form (tests)
    platform: str | None = None       # the target `attention` is resolved for (default: jax's
                                      # default backend; an ahead-of-time compile names its own)
    scan_unroll: int = 1              # layers per loop iteration of the layer scan
    stacked_layers: bool = True       # False: one parameter tree per layer ("layer_0", ...; see
                                      # `unstack_layers`), the layers unrolled in the program
    grouped_matmul: str = "xla"       # a group-quantized kernel's matmul: xla (dequantized into
                                      # it) | pallas (wedlm_jax.grouped_matmul: GPU, TPU)

    @nn.compact
    def __call__(self, tokens, positions, *, segment_ids=None, mask=None,
                 kv_cache: KVCache | None = None, cache_len=None,
                 structure=None, objective: str = "dual", return_hidden: bool = False,
                 lora_index=None):
        """Logits [B, S, V] (float32), with the updated cache in cache mode. `return_hidden`:
        (final hidden states [B, S, E], head [E, V]) instead of logits, for a loss that forms the
        logits a chunk at a time (`wedlm_jax.losses.chunked_loss_terms`); not in cache mode.
        `lora_index` [B] int32: each sequence's row of the params' adapter table (lora_table)."""
        c = self.config
        if return_hidden and kv_cache is not None:
            raise ValueError("return_hidden is for training (no cache); cache mode returns logits")
        remat_policy(self.remat)
        mask = attention_input(self, tokens.shape, segment_ids=segment_ids, mask=mask,
                               kv_cache=kv_cache, cache_len=cache_len, structure=structure,
                               objective=objective)

        embedding = _param(self, "embedding", (c.vocab_size, c.hidden_size), ("vocab", "embed"),
                           dtype=self.param_dtype)
        x = quantize.embed(embedding, tokens, self.dtype)
        x = _constrain(x, ("batch", "length", "embed"))
        inv_freq, scaling = rope_frequencies(c)
        cos, sin = rope_cos_sin(positions, inv_freq, scaling)
        form = quantize.matmul_form(self.platform or jax.default_backend(), self.grouped_matmul,
                                    self.attention_interpret)

        if self.stacked_layers:
            carry = (x, kv_cache, jnp.zeros((), jnp.int32))
            carry, _ = layer_stack(c, self.dtype, self.param_dtype, self.remat,
                                   unroll=self.scan_unroll, quant_form=form)(
                carry, cos, sin, mask, cache_len, lora_index)
        else:   # the layer index a Python int: a kernel can read its layer of the cache in place
            carry = (x, kv_cache, 0)
            for i in range(c.num_layers):
                carry, _ = _block(self.remat)(c, self.dtype, self.param_dtype, form,
                                              name=f"layer_{i}")(
                    carry, cos, sin, mask, cache_len, lora_index)
        x, new_cache, _ = carry
        x = RMSNorm(c.rms_norm_eps, "norm", self.param_dtype, name="final_norm")(x)
        if c.tie_word_embeddings:
            head = quantize.transpose_table(embedding)
        else:
            head = _param(self, "lm_head", (c.hidden_size, c.vocab_size), ("embed", "vocab"),
                          dtype=self.param_dtype)
        if return_hidden:
            return x, head
        logits = head_logits(x, head, self.dtype)
        if kv_cache is None:
            return logits
        return logits, new_cache


def head_logits(x, head, dtype):
    """Float32 logits [B, S, V] of final hidden states [B, S, E] through the head [E, V] (matmul in
    the compute `dtype`, accumulated in float32)."""
    return _constrain(quantize.head_matmul(x, head, dtype), ("batch", "length", "vocab"))


def attention_input(m: "Transformer", shape, *, segment_ids=None, mask=None, kv_cache=None,
                    cache_len=None, structure=None, objective: str = "dual"):
    """What every layer's attention receives for a forward of `shape` (B, S) by the Transformer
    `m` (its attention kernel and tile settings): a dense boolean mask [B, S, T] (dense path
    outside cache mode) or an `AttentionContext` (tiled / splash / cudnn, and every cache-mode
    implementation: built once per forward, shared by the layers). One of three inputs: a
    cache (`kv_cache`, `cache_len`), a training `structure`, or a sequence's `segment_ids` /
    explicit `mask` (neither: causal); mixing them is an error."""
    if structure is not None and (mask is not None or segment_ids is not None
                                  or kv_cache is not None):
        raise ValueError("pass a structure alone (no mask, segment_ids or kv_cache)")
    if kv_cache is not None:
        if mask is not None or segment_ids is not None or cache_len is None:
            raise ValueError("cache mode takes kv_cache and cache_len, and no mask/segment_ids")
        return _cache_input(m, shape, kv_cache, cache_len)
    if structure is not None:
        return _structure_input(m, shape, structure, objective)
    return _sequence_input(m, shape, segment_ids, mask)


def _resolved(m: "Transformer", layout: str) -> str:
    return attn_backends.resolve(m.attention, layout, backend=m.platform, dtype=m.dtype,
                                 interpret=m.attention_interpret)


def _cache_input(m: "Transformer", shape, kv_cache, cache_len):
    """Cache mode's context: the paged pool's, or the dense cache's (its rows checked)."""
    c, (b, s) = m.config, shape
    if paged.is_paged(kv_cache):
        paged.check_paged_cache(c.num_layers, c.num_kv_heads, c.head_dim, b, kv_cache)
        page = kv_cache["pool"].shape[1]
        return paged.PagedContext(jnp.asarray(cache_len, jnp.int32),
                                  paged.implementation_for(m.platform or jax.default_backend(),
                                                           m.attention),
                                  max(1, m.kv_tile // page), m.attention_interpret)
    impl = _resolved(m, "cache")
    check_kv_cache(c, kv_cache)
    if s > kv_cache["k"].shape[2]:
        raise ValueError(f"{s} new slots do not fit a cache of {kv_cache['k'].shape[2]} rows")
    return attn_backends.make_context(impl, cache_len=cache_len, batch=b, tile=m.kv_tile,
                                      interpret=m.attention_interpret)


def _structure_input(m: "Transformer", shape, structure, objective: str):
    """A training structure's mask (dense path) or tiled context (the dual-stream template)."""
    b = shape[0]
    impl = _resolved(m, "structure")
    if impl == attn_backends.DENSE:
        return masking.structure_mask(tiled_lib.as_structure(structure, b))
    return attn_backends.make_context(
        impl, q_struct=structure, k_struct=structure, batch=b, tile=m.attention_tile,
        template="dual" if objective == "dual" else "causal",
        block_size=m.attention_block_size, interpret=m.attention_interpret)


def _sequence_input(m: "Transformer", shape, segment_ids, mask):
    """A plain sequence's: an explicit mask [S, T] or [B, S, T], or causal within segments."""
    b, s = shape
    if mask is not None:
        if segment_ids is not None:
            raise ValueError("pass either an explicit mask or segment_ids, not both")
        _resolved(m, "mask")
        return jnp.broadcast_to(mask[None], (b,) + mask.shape) if mask.ndim == 2 else mask
    impl = _resolved(m, "causal")
    if impl == attn_backends.DENSE:
        return attn_lib.segment_mask(segment_ids, b, s)
    st = tiled_lib.causal_structure(segment_ids, b, s)
    return attn_backends.make_context(impl, q_struct=st, k_struct=st, segment_ids=segment_ids,
                                      batch=b, tile=m.attention_tile,
                                      interpret=m.attention_interpret)


def init_params(config: ModelConfig, rng: jax.Array, param_dtype=jnp.float32):
    """Random parameters (unboxed) for `config`."""
    model = Transformer(config, param_dtype=param_dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.jit(lambda r: nn.meta.unbox(model.init(r, tokens, tokens)["params"]))(rng)


def param_logical_axes(config: ModelConfig):
    """Tree (matching the params) of logical-axis-name tuples, computed without allocating."""
    model = Transformer(config)
    tokens = jnp.zeros((1, 1), jnp.int32)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))["params"]
    specs = nn.get_partition_spec(boxed)
    return jax.tree.map(lambda p: tuple(p), specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def unstack_layers(tree, num_layers: int):
    """A tree shaped like the params with the layers stacked ("layers": every leaf [L, ...]) ->
    one tree per layer ("layer_0" .. "layer_{L-1}", leaves [...]), what `Transformer(...,
    stacked_layers=False)` takes. Leaves may be arrays, ShapeDtypeStructs or logical-axis
    tuples (the layer axis dropped). Decoding on GPU holds its weights this way: XLA:GPU copies
    a layer's weights out of the stacked buffer at every step (BENCHMARKS.md)."""
    def layer(i):
        def pick(x):
            if isinstance(x, tuple):
                return x[1:]
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
            return x[i]
        return jax.tree.map(pick, tree["layers"], is_leaf=lambda x: isinstance(x, tuple))
    out = {k: v for k, v in tree.items() if k != "layers"}
    out.update({f"layer_{i}": layer(i) for i in range(num_layers)})
    return out


def layers_stacked(params) -> bool:
    """Whether `params` holds its layers stacked ("layers") or one tree per layer."""
    return "layers" in params


def param_shapes(config: ModelConfig, param_dtype=jnp.float32):
    """Tree of jax.ShapeDtypeStruct for the params of `config`."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0), param_dtype))


def init_kv_cache(config: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """The K/V cache, zeros: {'k', 'v'}, each [layers, B, capacity, kv_heads, head_dim] (the
    layer scan reads and writes one layer's slice per step). The one constructor of the cache.
    An int8 `dtype`: each row its D int8 values and its scale (`attention.kv_quant`, D + 4 wide)."""
    shape = (config.num_layers, batch, capacity, config.num_kv_heads,
             kv_quant.cache_width(config.head_dim, dtype))
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def kv_cache_logical_axes(config: ModelConfig):
    """Tree (matching `init_kv_cache`) of logical-axis tuples (see `axis_rules.AxisRules`)."""
    axes = ("layers", "batch", "cache_length", "kv_heads", "head_dim")
    return {"k": axes, "v": axes}


def check_kv_cache(config: ModelConfig, kv_cache) -> None:
    """A ValueError naming what is wrong unless `kv_cache` has `init_kv_cache`'s structure."""
    if not isinstance(kv_cache, dict) or set(kv_cache) != {"k", "v"}:
        raise ValueError("kv_cache must be the dict {'k', 'v'} of model.init_kv_cache, got "
                         f"{type(kv_cache).__name__}")
    c = config
    for name, buf in kv_cache.items():
        width = kv_quant.cache_width(c.head_dim, buf.dtype)
        if (buf.ndim != 5 or buf.shape[0] != c.num_layers
                or tuple(buf.shape[3:]) != (c.num_kv_heads, width)
                or buf.shape[1:3] != kv_cache["k"].shape[1:3]):
            raise ValueError(f"kv_cache[{name!r}] has shape {tuple(buf.shape)}; the model needs "
                             f"[layers={c.num_layers}, batch, capacity, kv_heads={c.num_kv_heads}, "
                             f"head_dim={width}] (model.init_kv_cache)")


def random_params(config: ModelConfig, seed: int = 0, head_scale: float = 1.0,
                  qk_scale: float = 1.0, vo_scale: float = 1.0):
    """Float32 params drawn from NumPy, fast where flax's op-by-op init is slow (tests, smoke runs,
    benchmarks over random weights): weights N(0, 0.02), norm scales 1 + N(0, 0.1). `head_scale`
    multiplies the LM head (peaky logits: the regime where parallel fills happen); `qk_scale` the
    q/k norm scales and `vo_scale` the v/o projections (how much attention mixes context)."""
    import numpy as np
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            x = 1.0 + 0.1 * rng.standard_normal(s.shape)
            return (x * qk_scale if ("q_norm" in name or "k_norm" in name) else x).astype(np.float32)
        w = 0.02 * rng.standard_normal(s.shape)
        if "lm_head" in name:
            w = w * head_scale
        if "v_proj" in name or "o_proj" in name:
            w = w * vo_scale
        return w.astype(np.float32)
    return jax.tree.map(jnp.asarray, jax.tree_util.tree_map_with_path(leaf, param_shapes(config)))
