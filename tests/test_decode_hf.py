"""AR decoding of the engine equals transformers' greedy `generate` on the same exported HF model,
token for token (a tiny random Qwen3 saved with save_pretrained, read with load_hf_checkpoint)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from decode.config import DecodeConfig, DecodeConfigError
from decode.static.static_batch import generate
from tests.synthetic.hf import make_hf_model
from wedlm_jax.checkpoints import load_hf_checkpoint


def test_ar_greedy_equals_transformers_generate(tmp_path):
    path = make_hf_model("qwen3", tmp_path / "hf", vocab=96, hidden=32, layers=2, heads=4, kv_heads=2,
                         head_dim=16, seed=3)
    config, params = load_hf_checkpoint(path, progress=False)
    assert config.mask_token_id is None
    prompts = [[5, 17, 33], [2, 9, 60, 0, 7, 44, 90], [11]]  # id 0 is also HF's pad id
    new = 20
    ours = generate(params, config, prompts, DecodeConfig(method="ar", max_new_tokens=new))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, ours.tokens):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        want = out[0, len(prompt):].tolist()
        assert len(want) == new
        assert got == want
    assert len(set(sum(ours.tokens, []))) > 5   # not a degenerate constant output
    # the same checkpoint has no mask token id: the diffusion methods refuse it before compiling
    with pytest.raises(DecodeConfigError, match="no mask_token_id"):
        generate(params, config, prompts, DecodeConfig(method="streaming"))
