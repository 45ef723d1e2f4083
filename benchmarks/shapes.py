"""The model shapes the benchmarks measure (Qwen3-8B down to 0.6B layouts, Qwen2.5-7B, the ~1B
training shape and a tiny one for smoke tests) and their random weights made on the device."""

from __future__ import annotations

_QWEN3 = dict(model_type="qwen3", qk_norm=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
              max_position_embeddings=40960)
# decode / prefill shapes, largest first (Qwen3-8B, -4B, -1.7B, -0.6B layouts): the suite's plan
# takes the largest that fits
DECODE_SHAPES = {
    "8b": dict(_QWEN3, vocab_size=151936, hidden_size=4096, intermediate_size=12288,
               num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
               tie_word_embeddings=False),
    "4b": dict(_QWEN3, vocab_size=151936, hidden_size=2560, intermediate_size=9728,
               num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
               tie_word_embeddings=True),
    "1.7b": dict(_QWEN3, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                 tie_word_embeddings=True),
    "0.6b": dict(_QWEN3, vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                 tie_word_embeddings=True),
}
# Qwen2.5-7B, the released WeDLM-7B's base, as configs/arch/qwen2.5-7b reads (benchmarks.compiled.compile_for
# --model 7b; not in the suite's plan, which stays within one family)
QWEN25_7B = dict(model_type="qwen2", qkv_bias=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 max_position_embeddings=131072, vocab_size=152064, hidden_size=3584,
                 intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                 head_dim=128, tie_word_embeddings=False)
# the ~1B training shape (Llama-3.2-1B-like layout with Qwen3 q/k norms), and the tiny ones
TRAIN_SHAPE = dict(_QWEN3, vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                   num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                   tie_word_embeddings=True)
SMOKE_SHAPE = dict(_QWEN3, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False)


def model_config(fields: dict):
    from wedlm_jax.config import ModelConfig
    return ModelConfig(**fields)


def device_params(config, seed: int = 0):
    """Random bf16 parameters generated on the device (weights N(0, 0.02), norm scales 1)."""
    import jax
    import jax.numpy as jnp

    from wedlm_jax.model import param_shapes
    shapes = param_shapes(config, jnp.bfloat16)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(leaves))
        out = []
        for k, (path, s) in zip(keys, leaves):
            if "scale" in jax.tree_util.keystr(path):
                out.append(jnp.ones(s.shape, jnp.bfloat16))
            else:
                out.append((0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(jnp.bfloat16))
        return jax.tree_util.tree_unflatten(treedef, out)
    return make(jax.random.key(seed))
