"""What the quantization tests share (tests/test_quantize.py, tests/test_kv_int8.py): a random
Qwen3-shaped model large enough for groups of 32 and 64 (hidden 128, 4 layers), the length of
the demo model's greedy AR continuations they compare, and the common prefix of two of them."""

from __future__ import annotations

from wedlm_jax.config import ModelConfig

CONFIG = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=128, intermediate_size=256,
                     num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                     mask_token_id=255)
AR_TOKENS = 48


def prefix_length(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
