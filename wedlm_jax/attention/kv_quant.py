"""The int8 KV cache: one int8 buffer whose rows carry their own scales.

A cached row (one token's key or value of one KV head, `head_dim` = D numbers) is stored as D int8
values followed by the four bytes of its float32 scale (symmetric absmax: scale = max |x| / 127,
values round(x / scale) in [-127, 127]); an int8 cache buffer's last axis is D + SCALE_BYTES. One
buffer, so everything that moves cache rows (a prefilled prompt inserted into a slot, pages
copied between shards, a live-slot bucket gathered and scattered back) moves the scales with
them, unchanged; only the two ends know: `to_cache` at the write (`attention.cache_write`,
`paged.write_pages`) and `from_cache` at the read (the dense and tiled cache attention, the paged
gather path), which dequantizes one tile at a time. A float cache passes through both unchanged.

    buf = jnp.zeros((..., cache_width(D, "int8")), storage_dtype("int8", "bfloat16"))
    buf = buf.at[rows].set(to_cache(k, buf.dtype))        # k [..., D] -> [..., D + 4] int8
    k = from_cache(buf[rows], jnp.bfloat16)               # [..., D] bfloat16
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from wedlm_jax.attention.table import KV_DTYPES

SCALE_BYTES = 4                # a row's float32 scale, bitcast to int8
QMAX = 127


def storage_dtype(kv_dtype: str, dtype) -> jnp.dtype:
    """The cache buffers' dtype: int8 for `kv_dtype` "int8", else the compute `dtype`."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is unknown; allowed: {', '.join(KV_DTYPES)}")
    return jnp.dtype(jnp.int8) if kv_dtype == "int8" else jnp.dtype(dtype)


def is_quantized(buf) -> bool:
    """Whether a cache buffer (or its shape struct) holds int8 rows with their scales."""
    return jnp.dtype(buf.dtype) == jnp.int8


def cache_width(head_dim: int, dtype) -> int:
    """The last axis of a cache buffer of `dtype` for heads of `head_dim`."""
    return head_dim + SCALE_BYTES if jnp.dtype(dtype) == jnp.int8 else head_dim


def head_dim_of(buf) -> int:
    """The head_dim of a cache buffer's rows."""
    return buf.shape[-1] - SCALE_BYTES if is_quantized(buf) else buf.shape[-1]


def row_bytes(head_dim: int, dtype) -> int:
    """Bytes one cached row takes in a buffer of `dtype` (the scale included)."""
    return cache_width(head_dim, dtype) * jnp.dtype(dtype).itemsize


def pack(x):
    """x [..., D] (any float dtype) -> [..., D + 4] int8: the values and their float32 scale."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    values = jnp.clip(jnp.round(xf / scale), -QMAX, QMAX).astype(jnp.int8)
    raw = jax.lax.bitcast_convert_type(scale[..., 0], jnp.int8)          # [..., 4]
    return jnp.concatenate([values, raw], axis=-1)


def unpack(packed, dtype):
    """[..., D + 4] int8 -> [..., D] in `dtype` (values x scale, computed in float32)."""
    d = packed.shape[-1] - SCALE_BYTES
    scale = jax.lax.bitcast_convert_type(packed[..., d:], jnp.float32)    # [...]
    return (packed[..., :d].astype(jnp.float32) * scale[..., None]).astype(dtype)


def to_cache(x, buffer_dtype):
    """New rows [..., D] as a cache buffer of `buffer_dtype` stores them."""
    return pack(x) if jnp.dtype(buffer_dtype) == jnp.int8 else x.astype(buffer_dtype)


def from_cache(rows, dtype):
    """Cache rows as numbers: an int8 buffer's dequantized into `dtype`, a float one's as they
    are (the caller casts)."""
    return unpack(rows, dtype) if is_quantized(rows) else rows


def float_view(buf, dtype):
    """The ShapeDtypeStruct a cache buffer's rows stand for ([..., D] of `dtype` for int8)."""
    shape = tuple(buf.shape[:-1]) + (head_dim_of(buf),)
    return jax.ShapeDtypeStruct(shape, dtype if is_quantized(buf) else buf.dtype)


def refuse(kernel: str, allowed: str) -> ValueError:
    """The one-line refusal of a kernel that reads float caches only."""
    return ValueError(f"kv_dtype int8 is not read by the {kernel}; use {allowed}")
