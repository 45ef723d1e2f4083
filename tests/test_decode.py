"""Decoding engine: the jitted while_loop engine against the no-cache step-by-step
reference (tests/decode_reference.py), cache consistency at every step against an independent full
forward, block stop-and-wait, metric identities, sampling, no-recompile, bad input.

Tiny random models (hidden 32, 2 layers, vocab 64). Random models give near-uniform logits, so the
LM head is scaled up to make the distributions peaky and exercise multi-slot fills. Every engine
call uses 3-4 prompts (batch bucket 4) and capacity <= 64 (one capacity bucket) so the handful of
compiled programs is shared across tests.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from tests import plans
from decode.engine.step import sampling
from decode.config import DecodeConfig, DecodeConfigError, Placement, Sampling
from decode.config import DecodeConfig as _DecodeConfig
from decode.engine.step.state import Request
from decode.engine.step.programs import compiled_count
from decode.engine.step.state import settings_rows
from decode.static.static_batch import generate, trace_steps
from tests.decode_cases import CAP, CONFIG, PROMPTS, TILE
from tests.decode_reference import FullForward, reference_generate
from tests.synthetic import random_params

def run(params, dc, prompts=PROMPTS, **kw):
    kw.setdefault("capacity", CAP)
    kw.setdefault("placement", Placement(kv_tile=TILE))
    return generate(params, CONFIG, prompts, dc, **kw)


def ref(params, dc, prompts=PROMPTS, capacity=CAP):
    return reference_generate(params, CONFIG, prompts, dc, capacity=capacity)


def assert_same(result, reference):
    for r, (got, want) in enumerate(zip(result.rows, reference)):
        assert result.tokens[r] == want["tokens"], (r, result.tokens[r], want["tokens"])
        assert got.steps == want["steps"], (r, got.steps, want["steps"])
        assert got.token_slots == want["n_fwd"], (r, got.token_slots, want["n_fwd"])


# ------------------------------------------------------------------------ engine == reference

@pytest.mark.parametrize("refill, window", [("after", 1), ("after", 4), ("after", 7),
                                            ("before", 1), ("before", 3), ("before", 8),
                                            ("before", 16)])
def test_streaming_equals_reference(params, refill, window):
    """Both refill orders (the official engine's 'before'; 'after', docs/algorithm.md §3's steps)
    against the plain no-cache implementation of the same order: tokens, forwards and slots, row by
    row."""
    settings = [(0.3, 0.0), (1.0, 0.05), (2.5, 0.1), (6.0, 0.5), (50.0, 0.0)]
    multi_fill = False
    for tau, lam in settings:
        dc = DecodeConfig(method="streaming", window=window, tau=tau, lam=lam, max_new_tokens=14,
                          refill=refill)
        got, want = run(params, dc), ref(params, dc)
        assert_same(got, want)
        assert all(len(t) == 14 for t in got.tokens)  # no stop ids: every row uses its budget
        multi_fill |= any(r.tokens_per_forward > 1.0 for r in got.rows)
    if window > 1:
        assert multi_fill  # the settings do exercise committing several tokens per forward


@pytest.mark.parametrize("refill", ["before", "after"])
def test_streaming_stop_tokens_and_small_budgets(params, refill):
    """Stop ids that occur mid-window end rows inclusively at different steps; a budget smaller
    than W and a capacity that cuts one row short shrink the window."""
    DecodeConfig = functools.partial(_DecodeConfig, refill=refill)
    free = run(params, DecodeConfig(window=4, tau=2.5, lam=0.05, max_new_tokens=14))
    # pick a stop id that row 0 emits somewhere in the middle
    stop = free.tokens[0][5]
    for dc, cap in [(DecodeConfig(window=4, tau=2.5, lam=0.05, max_new_tokens=14, stop_token_ids=(stop, 0)), CAP),
                    (DecodeConfig(window=4, tau=2.5, lam=0.05, max_new_tokens=3), CAP),
                    (DecodeConfig(window=4, tau=6.0, lam=0.0, max_new_tokens=2), CAP),
                    (DecodeConfig(window=4, tau=1.0, lam=0.05, max_new_tokens=30), 14)]:
        got, want = run(params, dc, capacity=cap), ref(params, dc, capacity=cap)
        assert_same(got, want)
    stopped = run(params, DecodeConfig(window=4, tau=2.5, lam=0.05, max_new_tokens=14, stop_token_ids=(stop,)))
    first = free.tokens[0].index(stop)
    assert stopped.tokens[0] == free.tokens[0][:first + 1]
    assert stopped.rows[0].finish == "stop"
    short = run(params, DecodeConfig(window=4, tau=1.0, lam=0.05, max_new_tokens=30), capacity=14)
    assert [len(t) for t in short.tokens] == [14 - len(p) for p in PROMPTS]
    assert [len(t) for t in run(params, DecodeConfig(window=4, max_new_tokens=3)).tokens] == [3] * 4


@pytest.mark.parametrize("refill", ["before", "after"])
def test_block_equals_reference(params, refill):
    for tau, lam in [(0.3, 0.0), (2.5, 0.1), (50.0, 0.0)]:
        dc = DecodeConfig(method="block", window=4, tau=tau, lam=lam, max_new_tokens=13,
                          stop_token_ids=(9,), refill=refill)
        assert_same(run(params, dc), ref(params, dc))


def test_ar_equals_reference(params):
    dc = DecodeConfig(method="ar", max_new_tokens=12)
    got, want = run(params, dc), ref(params, dc)
    assert_same(got, want)
    stop = got.tokens[1][4]
    dc = DecodeConfig(method="ar", max_new_tokens=12, stop_token_ids=(stop,))
    assert_same(run(params, dc), ref(params, dc))


# ------------------------------------------------------------------------ cache consistency

@pytest.mark.parametrize("method, refill", [("streaming", "before"), ("streaming", "after"),
                                            ("block", "before"), ("block", "after")])
def test_cache_consistency_every_step(params, method, refill):
    """At every step, the window's logits (forward on the KV cache) equal a full forward without a
    cache of [committed tokens ; reordered window] within 1e-4."""
    dc = DecodeConfig(method=method, window=4, tau=2.5, lam=0.05, max_new_tokens=12, refill=refill)
    cap = 16  # cuts rows 1 and 3 short: rows finish at different steps
    trace, final = trace_steps(params, CONFIG, PROMPTS, dc, capacity=cap,
                               placement=Placement(kv_tile=TILE))
    full = FullForward(params, CONFIG, CAP + 2 * dc.window)
    checked, worst = 0, 0.0
    for aux in trace:
        for r, prompt in enumerate(PROMPTS):
            if not aux["live"][r]:
                assert aux["n"][r] == final["n"][r]   # a finished row stops changing
                continue
            n, wlen = int(aux["n"][r]), int(aux["wlen"][r])
            committed = prompt + final["out"][r, :n - len(prompt)].tolist()
            fed, pos = aux["tokens"][r, :wlen].tolist(), aux["positions"][r, :wlen].tolist()
            want = full(committed + fed, list(range(n)) + pos)[n:]
            diff = np.abs(aux["logits"][r, :wlen] - want).max()
            worst = max(worst, diff)
            checked += 1
    assert checked > 12
    assert worst <= 1e-4, worst
    assert not all(aux["live"].all() for aux in trace)   # rows finished at different steps
    # the host-stepped trace and the while_loop produce the same tokens
    looped = run(params, dc, capacity=cap)
    assert [final["out"][r, :final["count"][r]].tolist() for r in range(4)] == looped.tokens
    assert [len(t) for t in looped.tokens] == [12, 7, 12, 11]


def test_block_commits_nothing_until_full(params):
    dc = DecodeConfig(method="block", window=4, tau=0.5, lam=0.0, max_new_tokens=11, refill="after")
    trace, final = trace_steps(params, CONFIG, PROMPTS, dc, capacity=CAP,
                               placement=Placement(kv_tile=TILE))
    saw_partial = False
    for aux in trace:
        for r in range(4):
            if not aux["live"][r]:
                continue
            c, wlen = int(aux["commit"][r]), int(aux["wlen"][r])
            assert c in (0, wlen), (c, wlen)          # all of the block or nothing
            filled = aux["filled_after"][r, :wlen]
            if c == 0 and filled.any() and not filled.all():
                saw_partial = True                    # some filled, still waiting
    assert saw_partial
    # a streaming run on the same settings commits partial windows (it does not wait)
    strace, _ = trace_steps(params, CONFIG, PROMPTS, dc.replace(method="streaming"), capacity=CAP,
                            placement=Placement(kv_tile=TILE))
    assert any(0 < int(a["commit"][r]) < int(a["wlen"][r]) for a in strace for r in range(4) if a["live"][r])


# ------------------------------------------------------------------------ metrics

@pytest.mark.parametrize("method, refill", [("streaming", "before"), ("streaming", "after"),
                                            ("block", "after"), ("ar", "after")])
def test_metric_identities(params, method, refill):
    res = run(params, DecodeConfig(method=method, window=4, tau=2.5, lam=0.05, max_new_tokens=9,
                                   stop_token_ids=(5,), refill=refill))
    span = 8 if refill == "before" else 4
    for toks, row in zip(res.tokens, res.rows):
        assert row.n_gen == len(toks)
        assert row.p_cache == pytest.approx(row.n_gen / row.token_slots)
        assert row.tokens_per_forward == pytest.approx(row.n_gen / row.steps)
        assert row.token_slots >= row.n_gen
        if method == "ar":
            assert row.steps == row.token_slots == row.n_gen
        else:
            assert row.token_slots <= span * row.steps
    assert res.n_gen == sum(len(t) for t in res.tokens)
    assert res.steps == sum(r.steps for r in res.rows)
    assert res.token_slots == sum(r.token_slots for r in res.rows)
    assert res.p_cache == pytest.approx(res.n_gen / res.token_slots)
    assert res.tokens_per_forward == pytest.approx(res.n_gen / res.steps)
    assert res.loop_iterations == max(r.steps for r in res.rows)  # ends when the last row ends
    assert res.wall_s > 0 and res.tokens_per_s == pytest.approx(res.n_gen / res.wall_s)


# ------------------------------------------------------------------------ sampling

def test_sampling_reproducible_and_top_k_one_is_greedy(params):
    base = dict(window=4, tau=2.5, lam=0.05, max_new_tokens=12)
    plain = random_params(CONFIG, 1)  # unscaled: near-uniform logits, sampling varies
    dc = DecodeConfig(temperature=1.0, seed=3, **base)
    a, b = run(plain, dc), run(plain, dc)
    assert a.tokens == b.tokens
    c = run(plain, dc.replace(seed=4))
    assert c.tokens != a.tokens
    greedy = run(plain, DecodeConfig(**base))
    assert run(plain, DecodeConfig(temperature=0.8, top_k=1, seed=5, **base)).tokens == greedy.tokens
    assert run(plain, DecodeConfig(temperature=0.8, top_p=1e-6, seed=6, **base)).tokens == greedy.tokens
    assert a.tokens != greedy.tokens


def _rows(temperature, top_k, top_p, temper_first):
    """One row's device SlotSettings from its Sampling options."""
    return settings_rows([Sampling(temperature=temperature, top_k=top_k, top_p=top_p,
                                   sampling_order="temper_first" if temper_first else "filter_first")])


def test_filter_logits_top_k_top_p():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]], np.float32))
    for tf in (False, True):
        k2 = np.asarray(sampling.filter_logits(logits, _rows(1.0, 2, 1.0, tf)))
        assert np.isfinite(k2[0, :2]).all() and np.isneginf(k2[0, 2:]).all()
        p = np.asarray(sampling.filter_logits(logits, _rows(1.0, 0, 0.8, tf)))   # 0.5+0.2 < 0.8 <= 0.85
        assert np.isfinite(p[0, :3]).all() and np.isneginf(p[0, 3:]).all()
        off = np.asarray(sampling.filter_logits(logits, _rows(2.0, 0, 1.0, tf)))
        np.testing.assert_allclose(off, logits / 2.0, rtol=1e-6)
    # the orders differ once the temperature changes the nucleus: at T = 0.5 the tempered
    # distribution is (0.80, 0.13, ...), so top-p 0.8 keeps two tokens there, three untempered
    first = np.asarray(sampling.filter_logits(logits, _rows(0.5, 0, 0.8, False)))
    temper = np.asarray(sampling.filter_logits(logits, _rows(0.5, 0, 0.8, True)))
    assert np.isfinite(first[0]).sum() == 3 and np.isfinite(temper[0]).sum() == 2
    np.testing.assert_allclose(first[0, :3], logits[0, :3] / 0.5, rtol=1e-6)


# ------------------------------------------------------------------------ compile once

def test_no_recompile_across_prompt_lengths_and_budgets(params):
    dc = DecodeConfig(window=4, tau=1.0, lam=0.05, max_new_tokens=10)
    run(params, dc)
    before = compiled_count()
    run(params, dc.replace(max_new_tokens=5, tau=0.2, lam=0.3, stop_token_ids=(3, 4)),
        prompts=[[7], [8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    run(params, dc.replace(max_new_tokens=20), prompts=[[2, 2], [3] * 11, [4] * 5, [6] * 2])
    res = run(params, dc.replace(max_new_tokens=7), capacity=33)   # same capacity bucket
    assert compiled_count() == before
    assert res.compile_s == 0.0
    fresh = run(params, dc, placement=Placement(kv_tile=8))   # a static setting is part of the key
    assert compiled_count() > before and fresh.compile_s > 0


# ------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("kw, words", [
    (dict(window=0), ["window", "0"]),
    (dict(tau=-0.1), ["tau", "-0.1"]),
    (dict(lam=-1.0), ["lam", "-1"]),
    (dict(temperature=-0.5), ["temperature", "-0.5"]),
    (dict(top_p=0.0), ["top_p", "(0, 1]"]),
    (dict(top_p=1.5), ["top_p", "1.5"]),
    (dict(top_k=-1), ["top_k", "-1"]),
    (dict(method="beam"), ["'beam'", "streaming", "block", "ar"]),
    (dict(max_new_tokens=0), ["max_new_tokens", "0"]),
])
def test_bad_decode_config(kw, words):
    with pytest.raises(DecodeConfigError) as e:
        DecodeConfig(**kw)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("method", ["streaming", "ar"])
def test_a_longer_prompt_bucket_changes_no_token(params, method):
    """generate(prompt_bucket=N) pads the prompts to N for one prefill program across batches;
    the tokens and forwards are those of the natural bucket, and a bad bucket is refused."""
    dc = DecodeConfig(method=method, window=4, tau=2.5, lam=0.05, max_new_tokens=10)
    natural = run(params, dc)
    padded = run(params, dc, prompt_bucket=32)
    assert padded.tokens == natural.tokens and padded.steps == natural.steps
    for bad in (0, 2.5, "32"):
        with pytest.raises(DecodeConfigError, match="prompt_bucket must be an int >= 1"):
            run(params, dc, prompt_bucket=bad)


def test_bad_inputs_fail_before_compiling(params):
    dc = DecodeConfig(window=4, max_new_tokens=4)
    before = compiled_count()
    with pytest.raises(DecodeConfigError, match="prompt 1 is empty"):
        run(params, dc, prompts=[[1], []])
    with pytest.raises(DecodeConfigError, match="prompt 0: 41 tokens, longer than the capacity 40"):
        run(params, dc, prompts=[[1] * 41])
    with pytest.raises(DecodeConfigError, match="token id 64 is outside"):
        run(params, dc, prompts=[[1, 64]])
    with pytest.raises(DecodeConfigError, match="non-empty list"):
        run(params, dc, prompts=[])
    no_mask = CONFIG.replace(mask_token_id=None)
    for method in ("streaming", "block"):
        with pytest.raises(DecodeConfigError, match="needs a mask token id"):
            generate(params, no_mask, PROMPTS, dc.replace(method=method), capacity=CAP)
    with pytest.raises(DecodeConfigError, match="capacity"):
        run(params, dc, capacity=0)
    with pytest.raises(DecodeConfigError, match="max_position_embeddings 32"):
        generate(params, CONFIG.replace(max_position_embeddings=32), PROMPTS, dc, capacity=CAP)
    with pytest.raises(DecodeConfigError, match="refill 'sideways' is unknown; allowed: before, after"):
        DecodeConfig(refill="sideways")
    with pytest.raises(DecodeConfigError, match="decoding needs ~.* GiB"):
        plans.decoder(params, CONFIG, slots=4, capacity=64, memory_limit_bytes=1000)
    assert compiled_count() == before
    # a checkpoint without a mask id still decodes AR, or anything once a mask id is given
    ar = generate(params, no_mask, PROMPTS, DecodeConfig(method="ar", max_new_tokens=4),
                  capacity=CAP, placement=Placement(kv_tile=TILE))
    assert ar.tokens == run(params, DecodeConfig(method="ar", max_new_tokens=4)).tokens
    given = generate(params, no_mask, PROMPTS, dc, capacity=CAP, mask_token_id=63,
                     placement=Placement(kv_tile=TILE))
    assert given.tokens == run(params, dc).tokens


def test_chunked_prefill_equals_one_shot(params):
    """Prefill in chunks of 7 (the last start pulled back inside the buffer) writes the same K/V
    for every prompt row as one chunk covering everything."""
    rng = np.random.default_rng(7)
    prompt = tuple(int(t) for t in rng.integers(0, 63, 125))
    kv = {}
    for chunk in (7, 128):
        dec = plans.decoder(params, CONFIG, window=4, slots=1, capacity=128, kv_tile=TILE,
                      prefill_chunk=chunk)
        kv[chunk] = dec.prefill(Request(prompt=prompt, max_new_tokens=2)).kv
    worst = 0.0
    for a, b in zip(jax.tree.leaves(kv[7]), jax.tree.leaves(kv[128])):
        worst = max(worst, float(np.abs(np.asarray(a[:, 0, :125]) - np.asarray(b[:, 0, :125])).max()))
    assert worst <= 1e-5, worst
    assert float(np.abs(np.asarray(jax.tree.leaves(kv[7])[0][1, 0, :125])).max()) > 1e-2


@pytest.mark.parametrize("order", ["filter_first", "temper_first"])
def test_sampler_frequencies_follow_temperature_top_k_top_p(order):
    """Draws of `choose_tokens` (one key per row, 4000 rows) match a plain implementation of each
    sampling order: chi-square against the exact probabilities, for temperature 0.7 alone, with
    top-k 3, with top-p 0.8, and top-p 0.8 at temperature 0.5 (where the orders differ)."""
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.12, 0.08], np.float32))
    rows = 4000
    keys = jax.random.split(jax.random.key(11), rows)
    batch = np.broadcast_to(logits, (rows, 1, 5))

    def exact(t, k, p):
        """Plain: the nucleus from the tempered (temper_first) or raw (filter_first) softmax,
        then the tempered softmax over the kept tokens."""
        base = np.exp(logits / t) if order == "temper_first" else np.exp(logits)
        base /= base.sum()
        keep = np.zeros(5, bool)
        keep[:k or 5] = True                                       # logits are sorted descending
        mass_before = np.concatenate([[0.0], np.cumsum(base / base[keep].sum() * keep)[:-1]])
        keep &= mass_before < p
        q = np.exp(logits / t) * keep
        return q / q.sum()

    for t, k, p in [(0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (0.5, 0, 0.8)]:
        st = settings_rows([Sampling(temperature=t, top_k=k, top_p=p, sampling_order=order)] * rows)
        draws = np.asarray(jax.jit(sampling.choose_tokens)(batch, keys, st))[:, 0]
        want = exact(t, k, p)
        counts = np.bincount(draws, minlength=5)
        assert counts[want == 0].sum() == 0, (t, k, p, counts)
        live = want > 0
        chi2 = (((counts[live] - rows * want[live]) ** 2) / (rows * want[live])).sum()
        assert chi2 < 20.0, (t, k, p, counts, want)   # df <= 4: p-value ~5e-4
