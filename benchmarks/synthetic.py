"""Random weights and random Hugging Face models for the benchmarks (no trained model, no download).

    random_params(config, seed, head_scale=..., qk_scale=..., vo_scale=...)   weights for a ModelConfig
    qwen3_hf_model(vocab=..., hidden=..., layers=..., ...)                   a random transformers model

The benchmarks' own, beside the tests' `tests.synthetic` (the benchmarks import nothing from the
tests): `random_params` draws the same numbers for the same seed, so a figure measured on random
weights before is measured on the same weights now.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax.model import param_shapes


def random_params(config, seed: int = 0, head_scale: float = 1.0, qk_scale: float = 1.0,
                  vo_scale: float = 1.0):
    """Float32 params drawn from NumPy (flax's op-by-op init is slow on a loaded CPU): weights
    N(0, 0.02), norm scales 1 + N(0, 0.1). `head_scale` multiplies the LM head (peaky logits: the
    regime where parallel fills happen); `qk_scale` the q/k norm scales and `vo_scale` the v/o
    projections (how much attention mixes context)."""
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


def qwen3_hf_model(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                   head_dim: int, intermediate: int | None = None, seed: int = 0):
    """A random `transformers` Qwen3ForCausalLM (float32, eval mode; torch and transformers are the
    `test` extra, imported here only); save it with `.save_pretrained(folder)` to load it as ours."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)
    return Qwen3ForCausalLM(cfg).eval()
