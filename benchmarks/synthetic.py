"""Random weights and random Hugging Face models for the benchmarks (no trained model, no download).

    random_params(config, seed, head_scale=..., qk_scale=..., vo_scale=...)   weights for a ModelConfig
                                        (wedlm_jax.model's, the same the tests draw)
    qwen3_hf_model(vocab=..., hidden=..., layers=..., ...)                   a random transformers model

The benchmarks import nothing from the tests.
"""

from __future__ import annotations

from wedlm_jax.model import random_params  # noqa: F401 (the library's, used here by name)


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
