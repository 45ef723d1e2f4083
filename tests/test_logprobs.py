"""Generated tokens' log-probabilities (docs/algorithm.md §6): each emitted token carries
the log-probability of the distribution it was chosen from.

References, independent of the carrying code:
- AR and verified: decode.serving.scoring.score, one causal forward over prompt + output (the AR reading);
- streaming and block: the step-by-step trace (decode.static.static_batch.trace_steps): for every slot a
  step fills, log_softmax of that forward's logits at the slot's physical index, recorded by
  absolute position; the token emitted at that position later must carry it.
Then the whole path (the compiled loop, ResultTokens, the Batcher's Finished) must give the same.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import plans
from decode.engine.runtime.batcher import Batcher
from decode.config import DecodeConfig, DecodeConfigError, Placement
from decode.engine.step.state import Request
from decode.serving.scoring import score
from decode.static.static_batch import generate, trace_steps
from tests.decode_cases import CAP, CONFIG, PROMPTS, TILE

MASK = CONFIG.mask_token_id


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _fill_time_logprobs(params, dc):
    """Per row: {absolute position: (token, log-probability)} of every slot a step filled, from
    the trace's logits (physical order) and the filled flags after the step (logical order)."""
    steps, _ = trace_steps(params, CONFIG, PROMPTS, dc, capacity=CAP,
                           placement=Placement(kv_tile=TILE))
    rec = [dict() for _ in PROMPTS]
    for aux in steps:
        for b in range(len(PROMPTS)):
            if not aux["live"][b]:
                continue
            n = int(aux["n"][b])
            for j in range(int(aux["wlen"][b])):
                i = int(aux["positions"][b, j]) - n           # the slot's logical index
                if aux["tokens"][b, j] == MASK and aux["filled_after"][b, i]:
                    lsm = _log_softmax(aux["logits"][b, j])
                    tok = int(np.argmax(aux["logits"][b, j]))  # greedy
                    rec[b][n + i] = (tok, float(lsm[tok]))
    return rec


@pytest.mark.parametrize("method,refill", [("streaming", "before"), ("streaming", "after"),
                                           ("block", "before")])
def test_window_methods_carry_the_fill_steps_logprob(params, method, refill):
    dc = DecodeConfig(method=method, window=4, refill=refill, max_new_tokens=14, tau=0.5, lam=0.05)
    rec = _fill_time_logprobs(params, dc)
    res = generate(params, CONFIG, PROMPTS, dc, capacity=CAP, placement=Placement(kv_tile=TILE))
    filled_several = False
    for b, prompt in enumerate(PROMPTS):
        assert len(res.logprobs[b]) == len(res.tokens[b]) > 0
        for k, (tok, lp) in enumerate(zip(res.tokens[b], res.logprobs[b])):
            want_tok, want_lp = rec[b][len(prompt) + k]
            assert tok == want_tok, (b, k)
            np.testing.assert_allclose(lp, want_lp, atol=1e-4, err_msg=f"row {b} token {k}")
        filled_several |= res.rows[b].tokens_per_forward > 1
    assert filled_several        # the window really held several filled slots at once
    # a later forward's reading at the same position differs: the carried value is the fill's
    ar_view = score(params, CONFIG, [p + t for p, t in zip(PROMPTS, res.tokens)])
    later = [np.asarray(s["token_logprobs"][len(p):]) for s, p in zip(ar_view, PROMPTS)]
    assert any(np.max(np.abs(np.asarray(lp) - v)) > 1e-3 for lp, v in zip(res.logprobs, later))


@pytest.mark.parametrize("method", ["ar", "verified"])
def test_ar_and_verified_carry_the_ar_reading(params, method):
    dc = DecodeConfig(method=method, window=4, max_new_tokens=12, tau=0.5, lam=0.05)
    res = generate(params, CONFIG, PROMPTS, dc, capacity=CAP, placement=Placement(kv_tile=TILE))
    want = score(params, CONFIG, [p + t for p, t in zip(PROMPTS, res.tokens)])
    for b, prompt in enumerate(PROMPTS):
        np.testing.assert_allclose(res.logprobs[b], want[b]["token_logprobs"][len(prompt):],
                                   atol=1e-4, err_msg=f"row {b}")


@pytest.mark.parametrize("method", ["streaming", "verified"])
def test_batcher_finished_carries_logprobs_and_top_alternatives(params, method):
    """Through continuous batching with top_logprobs 3: each token's value equals the static
    batch's, the alternatives are the 3 likeliest, best first, and greedy picks the first."""
    dc = DecodeConfig(method=method, window=4, max_new_tokens=10, tau=0.5, lam=0.05)
    alone = generate(params, CONFIG, PROMPTS, dc, capacity=CAP, placement=Placement(kv_tile=TILE))
    dec = plans.decoder(params, CONFIG, method=method, window=4, slots=2, capacity=CAP, kv_tile=TILE,
                  steps_per_call=3, top_logprobs=3)
    batcher, done = Batcher(dec), {}
    ids = [batcher.submit(Request(prompt=tuple(p), max_new_tokens=10, tau=0.5, lam=0.05,
                                  top_logprobs=3 if i != 1 else 0),
                          on_finish=lambda f: done.__setitem__(f.request_id, f))
           for i, p in enumerate(PROMPTS)]
    batcher.run_until_idle()
    for b, rid in enumerate(ids):
        fin = done[rid]
        assert fin.tokens == alone.tokens[b]
        assert len(fin.logprobs) == len(fin.tokens)
        np.testing.assert_allclose([lp for lp, _ in fin.logprobs], alone.logprobs[b], atol=1e-5)
        if b == 1:       # this request asked for no alternatives
            assert all(top == {} for _, top in fin.logprobs)
            continue
        for tok, (lp, top) in zip(fin.tokens, fin.logprobs):
            vals = list(top.values())
            assert len(top) == 3 and vals == sorted(vals, reverse=True)
            assert next(iter(top)) == tok and abs(vals[0] - lp) < 1e-6
            assert all(v <= 0 for v in vals)


def test_top_logprobs_bounds(params):
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(DecodeConfigError, match="top_logprobs"):
            plans.decoder({}, CONFIG, top_logprobs=bad, capacity=CAP)
    dec = plans.decoder(params, CONFIG, capacity=CAP, top_logprobs=2)
    for bad in (3, -1, 1.5):
        with pytest.raises(DecodeConfigError, match=r"top_logprobs must be an int in \[0, 2\]"):
            dec.check_request(Request(prompt=(1, 2), top_logprobs=bad))
