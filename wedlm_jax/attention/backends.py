"""Choosing the attention implementation, and the accelerator kernels (cuDNN on GPU, splash on TPU).

`attention` (a model / train config field) is one of

    dense   `attention.attend` over the dense [B, S, T] mask (the reference; any backend, any mask)
    tiled   `attention.tiled.tiled_attention`: pure JAX, computes only the tile pairs the
            structure allows (CPU, GPU, TPU)
    splash  TPU only: the Pallas splash-attention kernel with a block-sparse mask built from the
            structure, under `jax.shard_map` on the mesh (`splash_attention`)
    cudnn   GPU only: cuDNN flash attention via `jax.nn.dot_product_attention(
            implementation='cudnn')`, for plain causal / segment-causal layouts (`cudnn_attention`)
    pallas  GPU only (Triton): the training structures, flash attention over the tile plan
            (`attention.flash.flash_attention`); cache-mode decoding, a ragged per-row kernel
            (`attention.cache.attend_cache_pallas`)
    auto    per backend and layout (`resolve`): TPU -> splash for causal and structured
            training layouts, tiled for cache mode; GPU -> cudnn for causal / segment-causal in
            bf16/fp16, pallas for the training structures and causal in other dtypes (the tiled
            path's XLA while loops launch a kernel per tile pair) and for cache mode (the XLA:GPU
            compile of the tiled path keeps a cache-sized copy); CPU -> tiled. An explicit dense
            mask always means dense.

Cache mode (layout "cache") has one path whatever the implementation:
`attention.cache.attend_cache(impl, ...)` with impl dense | tiled | pallas | cudnn, reached through
an `AttentionContext` carrying cache_len and the KV tile (`Transformer.kv_tile`). Splash does not
express it (its block mask is static; the cache rule's offset cache_len[b] is per row at runtime).

Layouts (what the caller has): "causal" (causal over physical order, optionally packed by segment
ids), "structure" (a training arrangement: dual-stream, section-4.1 reorder, AR), "cache"
(cache-mode decoding), "mask" (an arbitrary explicit boolean mask).

An implementation that cannot run here (splash off TPU, cudnn / pallas off GPU, a layout a
kernel does not express) raises `AttentionUnavailable` naming the backend and the implementations
that do run here (`available`), before anything is compiled. With `interpret=True` (the model's
`attention_interpret`) the accelerator kernels run anywhere in a CPU-checkable form: Pallas in
interpret mode, the cuDNN call through `implementation='xla'` with the same arguments. This is how
the CI (CPU only) checks them against the dense reference; the compiled GPU/TPU paths are not run
in CI.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax.attention import cache as ca
from wedlm_jax.attention import flash as fa
from wedlm_jax.attention import tiled as ta
from wedlm_jax.attention.table import (AUTO, BACKENDS, CUDNN, DENSE, IMPLEMENTATIONS,  # noqa: F401
                                       LAYOUTS, PALLAS, SPLASH, TILED)
from wedlm_jax import sharding
from wedlm_jax.config import ConfigError

SPLASH_BLOCK = 128
_PLATFORM_NAMES = {"tpu": "TPU", "gpu": "GPU (CUDA)"}


class AttentionUnavailable(ConfigError):
    """The chosen attention implementation cannot run on this backend / for this layout."""


def validate(name: str) -> None:
    if name not in IMPLEMENTATIONS:
        raise ConfigError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}; got {name!r}")


def _platform(backend: str | None) -> str:
    b = (backend or jax.default_backend()).lower()
    return "gpu" if b in ("gpu", "cuda", "rocm") else b


def _half(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16),
                                                      jnp.dtype(jnp.float16))


def _runs(name: str, layout: str, platform: str, dtype, interpret: bool) -> bool:
    b = BACKENDS[name]
    if layout not in b.layouts:
        return False
    if b.platforms is not None and platform not in b.platforms and not interpret:
        return False
    return (b.dtypes is None or dtype is None or interpret
            or jnp.dtype(dtype).name in b.dtypes)


def available(layout: str, *, backend: str | None = None, dtype=None,
              interpret: bool = False) -> list[str]:
    """The concrete implementations that run for `layout` on `backend` (default: jax's default
    backend) in `dtype`. `interpret=True` counts the accelerator kernels as runnable anywhere
    (Pallas interpret mode, cuDNN's argument set through XLA): for checking them on CPU."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    platform = _platform(backend)
    return [n for n in BACKENDS if _runs(n, layout, platform, dtype, interpret)]


def resolve(name: str, layout: str, *, backend: str | None = None, dtype=None,
            interpret: bool = False) -> str:
    """The concrete implementation ("dense" | "tiled" | "splash" | "cudnn" | "pallas") for
    `name` on `backend` (default: jax's default backend) and `layout`. Raises
    `AttentionUnavailable` naming the implementations that do run here."""
    validate(name)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    platform = _platform(backend)
    if name == AUTO:
        if layout == "mask":
            return DENSE
        if platform == "tpu" and layout in ("causal", "structure"):
            return SPLASH
        if platform == "gpu" and layout == "causal" and _half(dtype):
            return CUDNN
        if platform == "gpu" and layout in ("causal", "structure"):
            return PALLAS
        if platform == "gpu" and layout == "cache":
            # XLA:GPU keeps a cache-sized copy around the tiled path's reads (H100 compile of the
            # 8B step: 4.70 GiB of temporaries at capacity 4096, 1.33 at 1024); the Pallas kernel
            # reads the cache in place (0.44 GiB): BENCHMARKS.md
            return PALLAS
        return TILED
    if _runs(name, layout, platform, dtype, interpret):
        return name
    here = ", ".join(available(layout, backend=platform, dtype=dtype, interpret=interpret))
    platforms, layouts = BACKENDS[name].platforms, BACKENDS[name].layouts
    if layout == "mask":
        raise AttentionUnavailable(
            f"attention={name!r} needs a structure (segment ids, a training arrangement or cache "
            f"lengths), not an explicit dense mask; use attention='dense' for explicit masks")
    if platforms is not None and platform not in platforms:
        raise AttentionUnavailable(
            f"attention={name!r} ({BACKENDS[name].title}) needs the "
            f"{' or '.join(_PLATFORM_NAMES[p] for p in platforms)} backend; this process runs on "
            f"the {platform!r} backend, where {layout!r} attention can use: {here}")
    if layout not in layouts:
        what = {SPLASH: "training layouts (causal, structure)",
                CUDNN: "plain causal / segment-causal and cache layouts"}.get(
            name, ", ".join(layouts))
        raise AttentionUnavailable(
            f"attention={name!r} handles {what} only, not {layout!r}; {layout!r} attention on "
            f"{platform!r} can use: {here} (or 'auto')")
    raise AttentionUnavailable(
        f"attention={name!r} (GPU cuDNN flash attention) takes bf16/fp16 inputs; got "
        f"{jnp.dtype(dtype).name} (use compute dtype bf16, or one of: {here})")


# ----------------------------------------------------------------------------------- cuDNN

def cudnn_attention(q, k, v, segment_ids, scale: float, *, implementation: str = "cudnn"):
    """Causal (segment-causal when `segment_ids` [B, S] is given; 0 = padding) grouped-query
    self-attention with cuDNN flash attention. q [B, S, H, D], k/v [B, S, KVH, D], bf16/fp16.

    Packing: documents are separated by a boolean mask [B, 1, S, S] (same non-zero segment),
    combined with the causal mask by cuDNN, so nothing leaks across documents; padding rows are
    zeroed afterwards (like `attention.attend`). Without segment ids only the causal mask.
    `implementation="xla"` runs the same call through XLA (any backend; for tests)."""
    mask = None
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids, jnp.int32)
        mask = ((seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, :, None])[:, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                       implementation=implementation)
    if segment_ids is not None:
        out = jnp.where((jnp.asarray(segment_ids) != 0)[:, :, None, None], out, 0)
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------------- splash

def splash_template(layout: str, length: int, block_size: int) -> np.ndarray:
    """The static [T, T] mask splash is built from, for arranged length `length`:
    "dual" -> the dual-stream mask of one document of length/2 tokens with `block_size`;
    "causal" -> lower triangular (plain 4.1 reorder, AR, segment-causal)."""
    if layout == "dual":
        if length % 2:
            raise ValueError(f"a dual-stream arrangement has even length; got {length}")
        from wedlm_jax import masking
        return masking.dual_stream_mask(length // 2, block_size)
    if layout == "causal":
        return np.tril(np.ones((length, length), bool))
    raise ValueError(f"splash template must be 'dual' or 'causal'; got {layout!r}")


def template_structure(layout: str, length: int, block_size: int) -> dict:
    """The structure (arrays [T]) the template mask is the `structure_mask` of."""
    idx = np.arange(length, dtype=np.int32)
    if layout == "dual":
        n = length // 2
        return {"stream": np.repeat(np.array([0, 1], np.int32), n),
                "block": np.concatenate([idx[:n] // block_size, idx[:n] // block_size])}
    return {"stream": None, "block": np.zeros(length, np.int32)}


def template_matches(structure, layout: str, block_size: int) -> jnp.ndarray:
    """bool scalar: the template mask ANDed with "same non-zero segment" (splash segment ids)
    equals the structure's mask exactly. Sufficient conditions checked: causal order is physical;
    within each document (a run of equal non-zero segment ids in a stream) the stream is the
    template's ("dual") or constant ("causal"), and the block differs from the template's block
    by one constant (so "same block" / "earlier block" agree); for "dual", prediction slot L + r
    belongs to the document of memory slot r and shares its offset. Documents packed at
    block-aligned offsets always match the dual template; others may not (the caller falls back)."""
    s = ta.as_structure(structure)
    t = s["segment"].shape[1]
    tmpl = template_structure(layout, t, block_size)
    seg, stream, block = s["segment"], s["stream"], s["block"]
    real = seg != 0
    off = tmpl["block"][None] - block
    ok = jnp.all(s["index"] == jnp.arange(t, dtype=jnp.int32)[None])
    if layout == "dual":
        n = t // 2
        ok &= jnp.all(~real | (stream == tmpl["stream"][None]))
        run = lambda a: a.reshape(a.shape[0], 2, n)
        seg2, off2, real2 = run(seg), run(off), run(real)
        ok &= jnp.all(~real2[:, 1] | ((seg2[:, 1] == seg2[:, 0]) & (off2[:, 1] == off2[:, 0])))
        adjacent = (seg2[:, :, 1:] == seg2[:, :, :-1]) & real2[:, :, 1:]
        ok &= jnp.all(~adjacent | (off2[:, :, 1:] == off2[:, :, :-1]))
    else:
        adjacent = (seg[:, 1:] == seg[:, :-1]) & real[:, 1:]
        ok &= jnp.all(~adjacent | ((off[:, 1:] == off[:, :-1])
                                   & (stream[:, 1:] == stream[:, :-1])))
    return ok


def _splash_kernel(layout: str, length: int, block_size: int, groups: int, block: int,
                  interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    template = splash_template(layout, length, block_size)
    mask = sa.MultiHeadMask([sa.NumpyMask(template) for _ in range(groups)])
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    return sa.make_splash_mqa_single_device(mask=mask, block_sizes=sizes, interpret=interpret)


def _splash_local(q, k, v, seg, scale, layout, block_size, interpret):
    """Per device: q [b, S, H, D], k/v [b, S, KVH, D], seg [b, S]."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    b, s, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    kernel = _splash_kernel(layout, s, block_size, g, SPLASH_BLOCK, interpret)
    qh = (q * scale).reshape(b, s, kvh, g, d).transpose(0, 2, 3, 1, 4)   # [b, KVH, G, S, D]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)            # [b, KVH, S, D]

    def one(qr, kr, vr, sr):                                              # one row, one KV head
        return kernel(qr, kr, vr, segment_ids=sa.SegmentIds(q=sr, kv=sr))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(qh, kh, vh, seg)                             # [b, KVH, G, S, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)
    return jnp.where((seg != 0)[:, :, None, None], out, 0).astype(q.dtype)


def splash_attention(q, k, v, structure, scale: float, *, layout: str, block_size: int = 32,
                     tile: int = 128, mesh=None, interpret: bool = False):
    """TPU self-attention for a training structure with the splash kernel.

    `layout` "dual" (dual-stream arrangement; `block_size` its block) or "causal" (section-4.1
    reorder, AR, segment-causal). The kernel's static block-sparse mask is the template of that
    layout for this length, document separation comes from splash segment ids (the structure's
    `segment`), padding rows are zeroed. When the structure does not match the template on every
    slot (`template_matches`: e.g. documents packed at offsets that are not multiples of the
    block size), the tiled path computes the same result instead (`lax.cond`): never a leak.
    With a `mesh` (default: the mesh set by `jax.set_mesh`, if any) it runs under
    `jax.shard_map`, batch over ('data', 'fsdp'), heads over 'tensor' when the KV heads divide.
    `interpret=True` runs the Pallas kernel in interpret mode (any backend; for tests)."""
    s = ta.as_structure(structure, q.shape[0])
    t = q.shape[1]
    if t % SPLASH_BLOCK:
        raise AttentionUnavailable(f"attention='splash' (TPU) needs a sequence length that is a "
                                   f"multiple of {SPLASH_BLOCK}; got {t}")

    def local(q, k, v, s):
        def fast(_):
            return _splash_local(q, k, v, s["segment"], scale, layout, block_size, interpret)

        def slow(_):
            return ta.tiled_attention(q, k, v, s, s, scale, tile_q=tile, tile_k=tile)

        return jax.lax.cond(template_matches(s, layout, block_size), fast, slow, None)

    return sharding.shard_rows(local, sharding.current_mesh(mesh), q, k, v, s)


# ------------------------------------------------------------------------ model dispatch

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """What every layer needs to run a non-dense implementation, or any cache-mode one (built
    once per forward by `make_context` and passed to the layers in place of the dense mask).

    impl        "dense" (cache mode only) | "tiled" | "splash" | "cudnn" | "pallas" (static)
    q_struct    structure of the queries [B, S] (tiled, splash)
    k_struct    structure of the keys [B, T] (tiled)
    plan        `attention.tiled.TilePlan` (tiled) or `attention.flash.flash_plan`'s padded
                structures and plan (pallas), shared by all layers
    segment_ids [B, S] or None (cudnn)
    template    splash template "dual" | "causal" (static); block_size its block (static)
    tile        the tile (static): tiled's tile plan, or the KV tile of cache mode
    cache_len   [B] in cache mode (then `attention.cache.attend_cache(impl, ...)` runs), else None
    interpret   (static) run the accelerator kernels in their CPU-checkable form: Pallas
                interpret mode, cuDNN's argument set through XLA
    """
    q_struct: dict | None
    k_struct: dict | None
    plan: ta.TilePlan | None
    segment_ids: jnp.ndarray | None
    impl: str = dataclasses.field(metadata=dict(static=True))
    template: str = dataclasses.field(default="causal", metadata=dict(static=True))
    block_size: int = dataclasses.field(default=32, metadata=dict(static=True))
    tile: int = dataclasses.field(default=128, metadata=dict(static=True))
    cache_len: jnp.ndarray | None = None
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))


def make_context(impl: str, *, q_struct=None, k_struct=None, segment_ids=None, batch: int,
                 tile: int = 128, template: str = "causal", block_size: int = 32,
                 cache_len=None, interpret: bool = False):
    """The `AttentionContext` of a resolved implementation: cache mode when `cache_len` [B] is
    given (any of `attention.cache.IMPLEMENTATIONS`, `tile` its KV tile), else a non-dense one."""
    if cache_len is not None:
        if impl not in ca.IMPLEMENTATIONS:
            raise ValueError(f"cache-mode attention must be one of "
                             f"{', '.join(ca.IMPLEMENTATIONS)}; got {impl!r}")
        return AttentionContext(None, None, None, None, impl, tile=ca.check_tile(tile),
                                cache_len=jnp.asarray(cache_len, jnp.int32), interpret=interpret)
    plan = None
    if impl == PALLAS:
        plan = fa.flash_plan(q_struct, k_struct, tile, batch)
    elif impl == TILED:
        q_struct, k_struct = ta.as_structure(q_struct, batch), ta.as_structure(k_struct, batch)
        plan = ta.tile_plan(q_struct, k_struct, tile, tile)
    elif impl == SPLASH:
        q_struct = ta.as_structure(q_struct, batch)
        k_struct = None
    elif impl == CUDNN:
        q_struct = k_struct = None
    else:
        raise ValueError(f"no attention context for implementation {impl!r}")
    return AttentionContext(q_struct, k_struct, plan, segment_ids, impl, template, block_size,
                            tile, interpret=interpret)


def apply(ctx: AttentionContext, q, k, v, scale: float, layer=None):
    """Run the context's implementation: q [B, S, H, D], k/v [B, T, KVH, D] -> [B, S, H, D]
    (cache mode with `layer`: k/v the stacked cache [L, B, T, KVH, D], read at that layer)."""
    if ctx.cache_len is not None:
        return ca.attend_cache(ctx.impl, q, k, v, ctx.cache_len, scale, tile=ctx.tile,
                               interpret=ctx.interpret, layer=layer)
    if ctx.impl == TILED:
        return ta.tiled_attention(q, k, v, ctx.q_struct, ctx.k_struct, scale, plan=ctx.plan)
    if ctx.impl == PALLAS:
        return fa.flash_attention(q, k, v, None, None, scale, plan=ctx.plan,
                                  interpret=ctx.interpret)
    if ctx.impl == SPLASH:
        return splash_attention(q, k, v, ctx.q_struct, scale, layout=ctx.template,
                                block_size=ctx.block_size, tile=ctx.tile,
                                interpret=ctx.interpret)
    if ctx.impl == CUDNN:
        return cudnn_attention(q, k, v, ctx.segment_ids, scale,
                               implementation="xla" if ctx.interpret else "cudnn")
    raise ValueError(f"unknown attention implementation {ctx.impl!r}")
