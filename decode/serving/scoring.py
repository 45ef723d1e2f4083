"""Scoring token sequences with the AR reading (docs/algorithm.md §1): WeDLM keeps causal
attention, so one forward of a sequence gives the log-probability of every token after the first
under the model's next-token distribution, as an OpenAI `echo: true, logprobs: N` answer reports
it (the first token has none; OpenAI and vLLM give null there).

    res = score(params, config, [ids, ...], top_n=5)
    res[i] = {"token_logprobs": [None, lp_1, ...], "top_logprobs": [None, {id: lp, ...}, ...]}

Sequences are batched into one forward per bucket (batch and length rounded up to powers of two,
so a bucket compiles once); padding goes after each sequence, where causal attention keeps it from
touching the real tokens. Log-probabilities are float32 whatever the compute dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from decode.config import MAX_LOGPROBS  # noqa: F401 (the bound)
from decode.config import DecodeConfigError, prompt_problem
from wedlm_jax import model as model_lib
from wedlm_jax.buckets import pow2_at_least

MIN_LENGTH_BUCKET = 16


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _score(config, dtype: str, top_n: int, params, tokens):
    """tokens [B, L] -> (log p(token t | tokens < t) for t >= 1 [B, L-1], top_n alternatives'
    log-probabilities and ids [B, L-1, top_n])."""
    model = model_lib.Transformer(config, dtype=jnp.dtype(dtype), attention="auto",
                                  stacked_layers=model_lib.layers_stacked(params))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits = model.apply({"params": params}, tokens, positions)
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    if top_n == 0:
        empty = jnp.zeros(picked.shape + (0,))
        return picked, empty, empty.astype(jnp.int32)
    top_lp, top_id = jax.lax.top_k(lp, top_n)
    return picked, top_lp, top_id.astype(jnp.int32)


def score(params, config, sequences, top_n: int = 0, dtype="float32") -> list[dict]:
    """Per sequence: `token_logprobs` (None, then one per token after the first) and
    `top_logprobs` (None, then {token id: log-probability} of the `top_n` likeliest next tokens;
    only when top_n > 0). A DecodeConfigError names a bad sequence or setting before any compile."""
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= MAX_LOGPROBS:
        raise DecodeConfigError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {top_n!r}")
    seqs = [list(s) for s in sequences]
    if not seqs:
        raise DecodeConfigError("no sequences to score")
    vocab, max_pos = config.vocab_size, config.max_position_embeddings
    for i, s in enumerate(seqs):
        if not s:
            raise DecodeConfigError(f"sequence {i} is empty")
        problem = prompt_problem(s, vocab)
        if problem:
            raise DecodeConfigError(f"sequence {i}: {problem}")
        if max_pos and len(s) > max_pos:
            raise DecodeConfigError(f"sequence {i} has {len(s)} tokens, past the model's "
                                    f"max_position_embeddings {max_pos}")
    length = pow2_at_least(max(len(s) for s in seqs), MIN_LENGTH_BUCKET)
    if max_pos:
        length = min(length, max(max_pos, max(len(s) for s in seqs)))
    batch = pow2_at_least(len(seqs))
    tokens = np.zeros((batch, length), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    shape_config = config.replace(mask_token_id=None, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None)
    picked, top_lp, top_id = jax.device_get(
        _score(shape_config, jnp.dtype(dtype).name, top_n, params, jnp.asarray(tokens)))
    out = []
    for i, s in enumerate(seqs):
        n = len(s) - 1
        row = {"token_logprobs": [None] + [float(x) for x in picked[i, :n]]}
        if top_n:
            row["top_logprobs"] = [None] + [
                {int(t): float(v) for t, v in zip(top_id[i, j], top_lp[i, j])} for j in range(n)]
        out.append(row)
    return out
