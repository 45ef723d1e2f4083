"""Tiny random Hugging Face models for tests and benchmarks, built offline with transformers + torch
(the `test` extra: imported inside the functions only)."""

from __future__ import annotations

import os

ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 10000.0},
}


def make_hf_model(arch: str, out_dir: str | os.PathLike, *, tie: bool = False, rope: str = "default",
                  seed: int = 0, vocab: int = 96, hidden: int = 32, layers: int = 2, heads: int = 4,
                  kv_heads: int = 2, head_dim: int | None = None, **extra) -> str:
    """Save a random `arch` (qwen2 | qwen3 | llama) model to `out_dir` and return the path."""
    import torch
    import transformers as tf

    classes = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
               "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}
    cfg_cls, model_cls = classes[arch]
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tie,
              rope_parameters=dict(ROPE[rope]), max_position_embeddings=4096, rms_norm_eps=1e-6)
    if head_dim is not None:
        kw["head_dim"] = head_dim
    kw.update(extra)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    # Random init leaves norms at 1 and biases at 0: perturb them so parity checks see them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return os.fspath(out_dir)


def hf_logits(path: str, tokens, positions):
    """Logits of the saved HF model (float32) for numpy tokens/positions [B, S]."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.array(tokens)),
                    position_ids=torch.as_tensor(np.array(positions)))
    return out.logits.numpy()
