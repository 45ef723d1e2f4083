"""Rotary position embedding fed explicit *logical* positions.

Topological reordering (the paper's central trick) moves slots physically while each keeps its
logical position; RoPE therefore takes a `positions[B, S]` array and never assumes `arange(S)`.
Frequencies follow transformers' `modeling_rope_utils` for the types listed in
`config.SUPPORTED_ROPE_TYPES`; each one is checked against it in tests/test_parity.py.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from wedlm_jax.config import SUPPORTED_ROPE_TYPES, ConfigError, ModelConfig


def rope_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq[head_dim // 2] float32, attention_scaling) for the config's RoPE type."""
    p = config.rope_params
    rope_type = p["rope_type"]
    dim = config.head_dim
    base = config.rope_theta
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(base) ** exponent)).astype(np.float32)
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(p["factor"])
    if rope_type == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32), 1.0
    orig_max = float(p.get("original_max_position_embeddings", config.max_position_embeddings))
    if rope_type == "llama3":
        low_ff, high_ff = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        low_wl, high_wl = orig_max / low_ff, orig_max / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (orig_max / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rope_type == "yarn":
        return _yarn(p, dim, base, factor, orig_max, exponent)
    raise ConfigError(f"RoPE type {rope_type!r} is not supported; supported: "
                      f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def _yarn(p, dim, base, factor, orig_max, exponent):
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(base) ** exponent
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def rope_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray, scaling: float):
    """cos, sin of shape [B, S, head_dim] (float32) for integer logical positions [B, S]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scaling, jnp.sin(emb) * scaling


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x: [B, S, H, D]; rotate-half convention (as the HF Qwen/Llama checkpoints use)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
