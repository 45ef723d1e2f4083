"""Scoring with the AR reading (decode/serving/scoring.py) against transformers on the same Hugging Face
folder: every token's log-probability within 1e-4 in float32, the top alternatives the same, a
batch of different lengths scored in one forward the same as each alone; bad input named."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from decode.config import DecodeConfigError
from decode.serving.scoring import MAX_LOGPROBS, score


def _reference(path, seq):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.numpy(), [float(lp[j, t]) for j, t in enumerate(seq[1:])]


def test_prompt_logprobs_equal_transformers(ckpt):
    path, config, params = ckpt
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, config.vocab_size, n)) for n in (23, 5, 40)]
    got = score(params, config, seqs, top_n=3)
    for seq, row in zip(seqs, got):
        full, want = _reference(path, [int(t) for t in seq])
        assert row["token_logprobs"][0] is None and row["top_logprobs"][0] is None
        np.testing.assert_allclose(row["token_logprobs"][1:], want, atol=1e-4)
        for j, top in enumerate(row["top_logprobs"][1:]):
            order = np.argsort(-full[j])[:3]
            assert list(top) == [int(t) for t in order]
            np.testing.assert_allclose(list(top.values()), full[j][order], atol=1e-4)
    alone = [score(params, config, [s])[0]["token_logprobs"] for s in seqs]
    # a row's scores do not depend on its batch: equal to float32 rounding (the CPU's matmul
    # code blocks a batch of 3 and of 1 differently: 3 ulps apart on an AVX-512 VM)
    np.testing.assert_allclose(np.concatenate([r["token_logprobs"][1:] for r in got]),
                               np.concatenate([a[1:] for a in alone]), atol=1e-5)
    assert len(alone[1]) == 5 and "top_logprobs" not in score(params, config, [seqs[1]])[0]


def test_bad_input_is_named(ckpt):
    _, config, params = ckpt
    with pytest.raises(DecodeConfigError, match=f"logprobs must be an int in \\[0, {MAX_LOGPROBS}\\]"):
        score(params, config, [[1, 2]], top_n=21)
    with pytest.raises(DecodeConfigError, match="sequence 1: token id 999 is outside"):
        score(params, config, [[1, 2], [3, 999]])
    with pytest.raises(DecodeConfigError, match="sequence 0 is empty"):
        score(params, config, [[]])
