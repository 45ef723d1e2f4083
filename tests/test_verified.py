"""Verified streaming decoding (decode/engine/step/verified.py): greedy output equal to the engine's AR
output token for token; the jitted step equal to the no-cache step-by-step reference
(tests/verified_reference.py) in tokens, steps and draft counts; committed K/V rows equal to a
one-shot prefill of the final sequence; sampled output distributed as AR sampling (chi-square); the
same tokens on a 4-device mesh as on one device.

Models: tiny random ones (hidden 32, 2 layers, vocab 64 or 16). Two regimes:
- `agree`: attention made nearly uniform (q/k norm scales 0.1) and its value/output projections
  large (x20), so each slot's hidden state is mostly an average over its context; the AR reading of
  slot j and the mask reading of slot j + 1 then see almost the same context and often agree, and
  the LM head is scaled x100 (peaky): drafts are often right and sometimes wrong;
- `plain`: the engine tests' random model with the LM head x30: drafts are almost always wrong.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.config import DecodeConfig, DecodeConfigError, Placement
from decode.engine.step.programs import compiled_count
from decode.static.static_batch import generate, trace_steps
from tests.decode_cases import CAP, CONFIG, PROMPTS, TILE
from tests.verified_reference import reference_verified
from tests.synthetic import random_params as make_params
from wedlm_jax.model import Transformer, init_kv_cache
from tests import xla


@pytest.fixture(scope="module")
def agree():
    return make_params(CONFIG, 0, head_scale=100.0, qk_scale=0.1, vo_scale=20.0)


@pytest.fixture(scope="module")
def plain(params):
    return params            # the engine tests' model (tests/conftest.py)


def run(params, dc, prompts=PROMPTS, capacity=CAP):
    return generate(params, CONFIG, prompts, dc, capacity=capacity,
                    placement=Placement(kv_tile=TILE))


def ar_of(params, dc, prompts=PROMPTS, capacity=CAP):
    return run(params, dc.replace(method="ar", window=1), prompts, capacity)


# ------------------------------------------------------------------ greedy: equal to AR

@pytest.mark.parametrize("refill, window", [("after", 1), ("after", 3), ("after", 6),
                                            ("before", 3), ("before", 6)])
def test_greedy_equals_ar(agree, plain, refill, window):
    """Many (tau, lambda) settings, both regimes, rows of different prompt lengths: the tokens equal
    AR's; no row takes more steps than AR; W = 1 is AR step for step."""
    saw = dict(accepted=0, rejected=0, faster=False)
    for params in (agree, plain):
        base = DecodeConfig(method="verified", window=window, max_new_tokens=16, refill=refill)
        ar = ar_of(params, base)
        for tau, lam in [(0.2, 0.0), (1.0, 0.05), (3.0, 0.1), (50.0, 0.0)]:
            got = run(params, base.replace(tau=tau, lam=lam))
            assert got.tokens == ar.tokens, (tau, lam)
            for r, (g, a) in enumerate(zip(got.rows, ar.rows)):
                assert g.steps <= a.steps, (r, g.steps, a.steps)
                assert g.n_gen == len(got.tokens[r]) == 16
                assert g.accepted + g.steps - 1 <= g.n_gen <= g.accepted + g.steps
                if window == 1:
                    assert g.steps == a.steps and g.accepted == g.rejected == 0
            saw["accepted"] += got.accepted
            saw["rejected"] += got.rejected
            saw["faster"] |= got.steps < ar.steps
    if window > 1:   # both verification paths ran, and drafts did save forwards
        assert saw["accepted"] > 0 and saw["rejected"] > 0 and saw["faster"], saw


def test_greedy_stop_tokens_budgets_capacity(agree):
    """Stop ids inside accepted runs end rows inclusively; budgets below W; a capacity that cuts
    rows short; a prompt that fills the capacity emits nothing (like AR)."""
    free = run(agree, DecodeConfig(method="verified", window=6, tau=3.0, lam=0.05, max_new_tokens=16))
    # a stop id whose first occurrence in some row is late (after several multi-token commits)
    row, stop = max(((r, t) for r, toks in enumerate(free.tokens) for t in toks),
                    key=lambda rt: free.tokens[rt[0]].index(rt[1]))
    cases = [
        (DecodeConfig(method="verified", window=6, tau=3.0, lam=0.05, max_new_tokens=16,
                      stop_token_ids=(stop,)), CAP, PROMPTS),
        (DecodeConfig(method="verified", window=6, tau=50.0, max_new_tokens=2), CAP, PROMPTS),
        (DecodeConfig(method="verified", window=6, tau=1.0, lam=0.05, max_new_tokens=5), CAP, PROMPTS),
        (DecodeConfig(method="verified", window=6, tau=3.0, max_new_tokens=30), 14, PROMPTS),
        (DecodeConfig(method="verified", window=6, tau=3.0, max_new_tokens=8), 9, [[1, 2], [3] * 9, [4], [5, 6, 7]]),
    ]
    for dc, cap, prompts in cases:
        got, ar = run(agree, dc, prompts, cap), ar_of(agree, dc, prompts, cap)
        assert got.tokens == ar.tokens, (dc, cap)
        assert [r.finish for r in got.rows] == [r.finish for r in ar.rows]
    stopped = run(agree, cases[0][0])
    assert free.tokens[row].index(stop) >= 3
    assert stopped.tokens[row] == free.tokens[row][:free.tokens[row].index(stop) + 1]
    assert stopped.rows[row].finish == "stop"
    short = run(agree, cases[3][0], capacity=14)
    assert [len(t) for t in short.tokens] == [14 - len(p) for p in PROMPTS]


# ------------------------------------------------------------------ jitted == no-cache reference

@pytest.mark.parametrize("refill, window", [("after", 3), ("after", 6), ("before", 3)])
def test_engine_equals_reference(agree, plain, refill, window):
    stop = run(agree, DecodeConfig(method="verified", window=window, max_new_tokens=12)).tokens[0][4]
    for params in (agree, plain):
        for tau, lam, stops, budget in [(1.0, 0.05, (), 12), (50.0, 0.0, (stop,), 12),
                                        (3.0, 0.1, (), 4)]:
            dc = DecodeConfig(method="verified", window=window, tau=tau, lam=lam,
                              max_new_tokens=budget, stop_token_ids=stops, refill=refill)
            got = run(params, dc)
            want = reference_verified(params, CONFIG, PROMPTS, dc, capacity=CAP)
            for r, w in enumerate(want):
                row = got.rows[r]
                assert got.tokens[r] == w["tokens"], (r, got.tokens[r], w["tokens"])
                assert (row.steps, row.token_slots, row.accepted, row.rejected) == \
                    (w["steps"], w["n_fwd"], w["accepted"], w["rejected"]), (r, row, w)


# ------------------------------------------------------------------ K/V validity

def test_committed_kv_rows_are_final(agree):
    """Every cache row below the final committed length equals the K/V of a one-shot causal
    prefill of the final sequence (prompt + output), all layers, within 1e-5; and at every step the
    committed slots were fed first, in natural order, as exactly the output tokens."""
    dc = DecodeConfig(method="verified", window=6, tau=3.0, lam=0.05, max_new_tokens=20)
    trace, final = trace_steps(agree, CONFIG, PROMPTS, dc, capacity=CAP,
                               placement=Placement(kv_tile=TILE))
    out, count, n = (np.asarray(final[k]) for k in ("out", "count", "n"))
    seqs = [p + out[r, :count[r]].tolist() for r, p in enumerate(PROMPTS)]
    assert sum(int(a["reject"][r]) for a in trace for r in range(4)) > 0
    assert sum(int(a["commit"][r]) > 1 for a in trace for r in range(4)) > 0
    for aux in trace:          # the committed run: physical 0..a-1 = logical, = the output
        for r in range(4):
            if not aux["live"][r]:
                continue
            n0, a = int(aux["n"][r]), int(aux["commit"][r])
            assert aux["positions"][r, :a].tolist() == list(range(n0, n0 + a))
            assert aux["tokens"][r, :a].tolist() == seqs[r][n0:n0 + a]
    length = max(len(s) for s in seqs)
    toks = np.zeros((4, length), np.int32)
    for r, s in enumerate(seqs):
        toks[r, :len(s)] = s
    rows = final["cache"]["k"].shape[2]  # [layers, batch, rows, kv_heads, head_dim]
    model = Transformer(CONFIG)
    _, ref_cache = jax.jit(lambda p, t: model.apply(
        {"params": p}, t, jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), t.shape),
        kv_cache=init_kv_cache(CONFIG, 4, rows), cache_len=jnp.zeros((4,), jnp.int32)))(agree, toks)
    worst, checked = 0.0, 0
    for layer in range(CONFIG.num_layers):
        for key in ("k", "v"):
            got_l, want_l = np.asarray(final["cache"][key][layer]), np.asarray(ref_cache[key][layer])
            for r, s in enumerate(seqs):
                m = min(int(n[r]), len(s))
                checked += m
                worst = max(worst, float(np.abs(got_l[r, :m] - want_l[r, :m]).max()))
    assert checked > 4 * 4 * 20 and worst <= 1e-5, (checked, worst)


# ------------------------------------------------------------------ sampling

SMALL = CONFIG.replace(vocab_size=16, mask_token_id=15)
S_PROMPT = [3, 9, 4]
S_TEMP, S_TOPK = 0.8, 12


def _np_filtered_probs(logits):
    """Temperature then top-k (an independent NumPy version of the engine's filter)."""
    x = logits.astype(np.float64) / S_TEMP
    kth = np.sort(x, axis=-1)[..., -S_TOPK][..., None]
    x = np.where(x < kth, -np.inf, x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _exact_ar(params):
    """P(t1, t2, t3) of AR sampling after S_PROMPT, from full forwards of every 2-token context."""
    v = SMALL.vocab_size
    t1, t2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
    ctx = np.concatenate([np.tile(S_PROMPT, (v * v, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    model = Transformer(SMALL)
    pos = np.broadcast_to(np.arange(ctx.shape[1]), ctx.shape)
    logits = np.asarray(jax.jit(lambda p, t, q: model.apply({"params": p}, t, q))(params, ctx, pos))
    p1 = _np_filtered_probs(logits[0, 2])                              # [v]
    p2 = _np_filtered_probs(logits[::v, 3])                            # [t1, v]
    p3 = _np_filtered_probs(logits[:, 4]).reshape(v, v, v)             # [t1, t2, v]
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi2(counts, expected, min_expected=5.0):
    """Pearson chi-square with the cells of expected count < min_expected pooled into one; returns
    (statistic, degrees of freedom)."""
    counts, expected = counts.ravel(), expected.ravel()
    small = expected < min_expected
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(expected[~small], expected[small].sum())
    keep = e > 0
    return float(((c[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


def _critical(df, z=3.0902):
    """Chi-square upper quantile by Wilson-Hilferty; z = 3.0902 is the standard normal quantile of
    1 - 1e-3, so this is the critical value at significance 0.001."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def _first3(params, method, seed, rows):
    dc = DecodeConfig(method=method, window=4, tau=50.0, lam=0.0, temperature=S_TEMP, top_k=S_TOPK,
                      max_new_tokens=3, seed=seed << 16, prefill_chunk=4)  # rows: seed + row
    res = generate(params, SMALL, [S_PROMPT] * rows, dc, capacity=8,
                   placement=Placement(kv_tile=TILE))
    return np.array(res.tokens), res


def test_sampling_matches_ar_distribution():
    """16384 samples (4096 rows, each its own random stream, x 4 seeds): the joint of the first two
    tokens and the joint of tokens 2 and 3 (drafted, then verified by speculative sampling) match
    AR sampling's exact distribution: chi-square, cells with expected count < 5 pooled, at
    significance 0.001, fixed seeds. Controls: the engine's AR sampling (8192 samples) passes the
    same test; plain streaming sampling (4096 samples: drafts from the mask reading, unverified)
    fails it."""
    params = make_params(SMALL, 5, head_scale=10.0, qk_scale=0.1, vo_scale=20.0)  # spread, agreeing
    joint = _exact_ar(params)
    stats = {}
    for method, seeds in (("verified", (11, 12, 13, 14)), ("ar", (21, 22)), ("streaming", (31,))):
        toks, acc, rej = [], 0, 0
        for seed in seeds:
            t, res = _first3(params, method, seed, 4096)
            toks.append(t)
            acc, rej = acc + res.accepted, rej + res.rejected
        toks = np.concatenate(toks)
        total = len(toks)
        c12, c23 = np.zeros((16, 16)), np.zeros((16, 16))
        np.add.at(c12, (toks[:, 0], toks[:, 1]), 1)
        np.add.at(c23, (toks[:, 1], toks[:, 2]), 1)
        s12, df12 = _chi2(c12, total * joint.sum(2))
        s23, df23 = _chi2(c23, total * joint.sum(0))
        stats[method] = (s12 / _critical(df12), s23 / _critical(df23), acc, rej)
    v12, v23, acc, rej = stats["verified"]
    assert acc > 4000 and rej > 2000, stats          # both branches of the rule ran often
    assert v12 < 1 and v23 < 1, stats
    assert stats["ar"][0] < 1 and stats["ar"][1] < 1, stats
    assert max(stats["streaming"][:2]) > 1, stats


def test_sampled_top_k_one_is_greedy_ar_and_seeded(agree):
    dc = DecodeConfig(method="verified", window=6, tau=3.0, lam=0.05, max_new_tokens=12,
                      temperature=0.7, top_k=1, seed=2)
    got = run(agree, dc)
    assert got.tokens == ar_of(agree, dc.replace(temperature=0.0, top_k=0)).tokens
    assert got.accepted > 0
    # temperature 1: a fixed seed reproduces; a stop id ends a row inclusively; the budget holds
    hot = dc.replace(temperature=1.0, top_k=0)
    a, b = run(agree, hot), run(agree, hot)
    assert a.tokens == b.tokens and a.accepted > 0 and a.rejected > 0
    assert run(agree, hot.replace(seed=3)).tokens != a.tokens
    stop = a.tokens[2][5]
    cut = run(agree, hot.replace(stop_token_ids=(stop,)))
    assert cut.tokens[2] == a.tokens[2][:a.tokens[2].index(stop) + 1]
    assert all(len(t) == 12 for t in a.tokens)


# ------------------------------------------------------------------ compile once, bad input

def test_no_recompile_across_prompts_budgets_settings(agree):
    dc = DecodeConfig(method="verified", window=3, tau=1.0, lam=0.05, max_new_tokens=10)
    run(agree, dc)
    before = compiled_count()
    run(agree, dc.replace(max_new_tokens=5, tau=0.2, lam=0.3, stop_token_ids=(3,)),
        prompts=[[7], [8, 9], list(range(1, 17))])
    res = run(agree, dc.replace(max_new_tokens=20), capacity=33)
    assert compiled_count() == before and res.compile_s == 0.0


@pytest.mark.parametrize("kw, words", [
    (dict(window=0), ["window", "0"]), (dict(tau=-1.0), ["tau"]), (dict(lam=-0.5), ["lam"]),
    (dict(temperature=-1.0), ["temperature"]), (dict(top_p=0.0), ["top_p"]),
])
def test_bad_config_for_verified(kw, words):
    with pytest.raises(DecodeConfigError) as e:
        DecodeConfig(method="verified", **kw)
    assert all(w in str(e.value) for w in words)


def test_verified_needs_a_mask_token(agree):
    with pytest.raises(DecodeConfigError, match="needs a mask token id"):
        generate(agree, CONFIG.replace(mask_token_id=None), PROMPTS,
                 DecodeConfig(method="verified", window=3), capacity=CAP)
    with pytest.raises(DecodeConfigError, match="greedy only"):
        reference_verified(agree, CONFIG, PROMPTS, DecodeConfig(method="verified", temperature=1.0))


# ------------------------------------------------------------------ mesh

MESH_SCRIPT = '''
import json
import jax
from decode.config import DecodeConfig, Placement
from decode.static.static_batch import generate
from tests.decode_cases import CONFIG, PROMPTS
from tests.synthetic import random_params as make_params

assert len(jax.devices()) == 4, jax.devices()
params = make_params(CONFIG, 0, head_scale=100.0, qk_scale=0.1, vo_scale=20.0)
out = {}
for temp in (0.0, 1.0):
    dc = DecodeConfig(method="verified", window=4, tau=3.0, lam=0.05, max_new_tokens=12,
                      temperature=temp, seed=7)
    one = generate(params, CONFIG, PROMPTS, dc, capacity=40, placement=Placement(kv_tile=16))
    sharded = generate(params, CONFIG, PROMPTS, dc, capacity=40,
                       placement=Placement(kv_tile=16, mesh=(2, 1, 2)))
    out[str(temp)] = [one.tokens, sharded.tokens, [one.steps, one.accepted, one.rejected],
                      [sharded.steps, sharded.accepted, sharded.rejected]]
print("RESULT " + json.dumps(out))
'''


def test_mesh_same_tokens_as_one_device():
    """Batch over 'data', heads over 'tensor' (4 forced CPU devices, in a subprocess): greedy and
    sampled verified decoding give the same tokens and counts as one device."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS=xla.flags(4), JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    for temp, (one, sharded, stats_one, stats_sharded) in json.loads(line[len("RESULT "):]).items():
        assert sharded == one and stats_sharded == stats_one, temp
        assert stats_one[1] > 0, temp            # drafts were accepted: the window path ran
