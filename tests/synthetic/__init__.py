"""Self-made inputs that tests and benchmarks share (no trained model, no downloads); not part of
the installed packages (pyproject.toml installs wedlm_jax, train, decode, demo), imported from the
checkout root:

    random_params(config, ...)          synthetic weights for any ModelConfig (below)
    tiny_bpe_tokenizer(corpus, ...)     a byte-level BPE tokenizer trained on a few strings (below)
    synthetic.hf                        tiny random Hugging Face models (torch + transformers: the
                                        `test` extra, imported inside its functions only)
    synthetic.train_data                tiny tokenizer + JSONL training inputs and configs
                                        (python -m tests.synthetic.train_data data/tiny)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax.model import param_shapes


def random_params(config, seed=0, head_scale=1.0, qk_scale=1.0, vo_scale=1.0):
    """Random params from NumPy (flax's op-by-op init is slow on a loaded CPU): weights N(0, 0.02),
    norm scales 1 + N(0, 0.1). Scaling the LM head by `head_scale` makes predictions confident
    (peaky logits: the regime where parallel fills happen); `qk_scale` (q/k norm scales) and
    `vo_scale` (v/o projections) shape how much attention mixes context."""
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


def tiny_bpe_tokenizer(corpus, special_tokens, vocab_size: int = 120):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` (a few strings), offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size,
                                                        special_tokens=list(special_tokens),
                                                        show_progress=False))
    return tok
