"""Logit parity with transformers (float32), natural order and a random physical permutation
with the logical positions carried along: the reordering WeDLM relies on."""

import numpy as np
import pytest

from tests.synthetic.hf import hf_logits, make_hf_model
from wedlm_jax.checkpoints import load_hf_checkpoint
from wedlm_jax.model import Transformer

CASES = [
    # (arch, tie, rope, extra)
    ("qwen2", False, "default", {}),                 # q/k/v bias
    ("qwen3", False, "default", {"head_dim": 16}),   # qk-norm, head_dim != hidden / heads (8)
    ("qwen3", True, "yarn", {"head_dim": 16}),
    ("llama", True, "default", {}),
    ("llama", False, "llama3", {}),
    ("qwen2", True, "linear", {}),
    ("llama", False, "yarn", {"attention_bias": True}),
]


def _inputs(rng, batch=2, length=12, vocab=96, permute=False):
    tokens = rng.integers(0, vocab, (batch, length))
    # Offsets put positions past original_max_position_embeddings (64) so scaled RoPE matters.
    positions = np.arange(length)[None] + rng.integers(0, 120, (batch, 1))
    if permute:
        perm = np.stack([rng.permutation(length) for _ in range(batch)])
        tokens = np.take_along_axis(tokens, perm, 1)
        positions = np.take_along_axis(positions, perm, 1)
    return tokens, positions


@pytest.mark.parametrize("arch,tie,rope,extra", CASES,
                         ids=[f"{a}-{'tied' if t else 'untied'}-{r}" for a, t, r, _ in CASES])
def test_logits_match_transformers(tmp_path, arch, tie, rope, extra):
    path = make_hf_model(arch, tmp_path / "hf", tie=tie, rope=rope, **extra)
    config, params = load_hf_checkpoint(path)
    assert config.tie_word_embeddings == tie and config.rope_params["rope_type"] == rope
    model = Transformer(config)
    rng = np.random.default_rng(0)
    for permute in (False, True):
        tokens, positions = _inputs(rng, permute=permute)
        ours = np.asarray(model.apply({"params": params}, tokens, positions))
        ref = hf_logits(path, tokens, positions)
        assert ours.shape == ref.shape
        diff = np.abs(ours - ref).max()
        assert diff <= 1e-4, (permute, diff)
        assert np.abs(ref).max() > 1e-2  # the comparison is not between two zero tensors
