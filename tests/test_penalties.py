"""The request's logit bias, presence / frequency / repetition penalties and min-p: the distribution
each gives against a NumPy reference; the counts a window's slot reads (the row's generated
tokens plus the drafts before it) against a loop; on the demo model, verified streaming equal to
AR under penalties (greedy) at every window, and each option changing what is decoded; the bad
values refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from decode.config import MAX_LOGIT_BIAS, DecodeConfig, DecodeConfigError, Sampling
from decode.engine.step import sampling
from decode.engine.step.state import Request, settings_rows
from decode.engine.step.steps import reads_before

V = 40


def np_adjust(x, seen, bias: dict, presence: float, frequency: float, repetition: float):
    """OpenAI's / vLLM's definitions, one row [S, V]."""
    x = x.astype(np.float64).copy()
    for t, b in bias.items():
        x[..., t] += b
    hit = seen > 0
    x = np.where(hit, np.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * seen - presence * hit


def np_filtered(x, t: float, k: int, p: float, min_p: float, temper_first: bool):
    """The sampling distribution of one slot [V]: top-k, top-p and min-p in the same domain
    (tempered first or not), then the temperature."""
    z = x / t if temper_first else x.copy()
    order = np.argsort(-z)
    keep = np.zeros_like(z, bool)
    keep[order[:k or len(z)]] = True
    prob = np.where(keep, np.exp(z - z.max()), 0.0)
    prob /= prob.sum()
    mass_before = np.cumsum(prob[order]) - prob[order]
    nucleus = np.zeros_like(keep)
    nucleus[order] = mass_before < p
    keep &= nucleus
    keep &= (z - z.max()) >= (np.log(min_p) if min_p > 0 else -np.inf)
    w = np.where(keep, np.exp((z if temper_first else z / t) - z[keep].max()), 0.0)
    return w / w.sum()


ROWS = [Sampling(temperature=0.7, top_k=0, top_p=1.0, min_p=0.2, presence_penalty=0.5,
                 frequency_penalty=0.3, repetition_penalty=1.4, logit_bias={"3": 5.0, 7: -100}),
        Sampling(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05, sampling_order="temper_first",
                 presence_penalty=-1.0, repetition_penalty=0.8),
        Sampling(temperature=1.0),                                     # every option off
        Sampling(temperature=0.5, top_p=0.8, frequency_penalty=2.0, logit_bias={"0": 2.5, "39": 1})]


def test_each_option_against_a_numpy_reference_of_the_filtered_distribution():
    rng = np.random.default_rng(0)
    b, s = len(ROWS), 3
    logits = rng.normal(0, 2.0, (b, s, V)).astype(np.float32)
    seen = rng.integers(0, 3, (b, s, V)) * (rng.random((b, s, V)) < 0.3)
    st = settings_rows(ROWS)
    x = sampling.adjust_logits(logits, st, seen.astype(np.int32))
    got = np.exp(np.asarray(sampling.filter_logits(x, st), np.float64))
    got /= got.sum(-1, keepdims=True)
    for i, r in enumerate(ROWS):
        for j in range(s):
            adj = np_adjust(logits[i, j], seen[i, j], dict(r.logit_bias), r.presence_penalty,
                            r.frequency_penalty, r.repetition_penalty)
            np.testing.assert_allclose(np.asarray(x[i, j]), adj, rtol=1e-5, atol=1e-4)
            want = np_filtered(adj, r.temperature, r.top_k, r.top_p, r.min_p,
                               r.sampling_order == "temper_first")
            np.testing.assert_allclose(got[i, j], want, atol=1e-5)
    off = np.asarray(sampling.adjust_logits(logits, settings_rows([Sampling()] * b), seen))
    np.testing.assert_array_equal(off, logits)                    # off: the logits unchanged
    assert np.asarray(sampling.penalty_rows(st)).tolist() == [True, True, False, True]
    # the greedy choice of an adjusted row is the argmax of its adjusted logits
    g = np.asarray(sampling.adjusted_greedy(logits, st, lambda: seen.astype(np.int32),
                                            np.argmax(logits, -1).astype(np.int32)))
    np.testing.assert_array_equal(g[[0, 1, 3]], np.argmax(np.asarray(x), -1)[[0, 1, 3]])
    np.testing.assert_array_equal(g[2], np.argmax(logits[2], -1))


def test_a_slot_counts_the_generated_tokens_and_the_window_before_it():
    rng = np.random.default_rng(1)
    b, w = 3, 6
    counts = rng.integers(0, 2, (b, V)).astype(np.int32)
    tok = rng.integers(0, V, (b, w)).astype(np.int32)
    filled = rng.random((b, w)) < 0.6
    order = np.stack([rng.permutation(w) for _ in range(b)]).astype(np.int32)   # physical -> logical
    n = np.array([5, 0, 9], np.int32)
    for first, inclusive in ((0, False), (1, True)):             # streaming; verified's AR reading
        before = reads_before(filled, n[:, None] + order, n, first, inclusive)
        got = np.asarray(sampling.seen_counts(counts, tok, before))
        for i in range(b):
            for p in range(w):
                want = counts[i].copy()
                for q in range(first, w):
                    if filled[i, q] and (q <= order[i, p] if inclusive else q < order[i, p]):
                        want[tok[i, q]] += 1
                np.testing.assert_array_equal(got[i, p], want)


@pytest.fixture(scope="module")
def demo():
    from demo.eval import DEMO_MODEL, eval_items, load_model
    config, params, tok = load_model(DEMO_MODEL, check=False)
    prompts = [tok.encode(it["prompt"]) for k in ("counting", "lists", "records")
               for it in eval_items(DEMO_MODEL, k, 1)]
    return config, params, prompts


# strong enough to bite on the demo model (its top logit leads by ~11)
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=4.0,
                 logit_bias={"20": 9.0, "24": -3.0})
NEW = 20


def reference_ar(config, params, prompts, s: Sampling) -> list:
    """AR greedy under `s`'s bias and penalties, token by token: the full forward of the whole
    sequence (no cache), the last position's logits adjusted by the NumPy reference."""
    import jax
    import jax.numpy as jnp
    from wedlm_jax import model as model_lib
    length = max(map(len, prompts)) + NEW
    fwd = jax.jit(lambda t: model_lib.Transformer(config).apply(
        {"params": params}, t, jnp.arange(length)[None]))
    out = []
    for p in prompts:
        seq, seen = list(p), np.zeros(config.vocab_size)
        for _ in range(NEW):
            logits = np.asarray(fwd(jnp.asarray([seq + [0] * (length - len(seq))])))[0, len(seq) - 1]
            nxt = int(np.argmax(np_adjust(logits, seen, dict(s.logit_bias), s.presence_penalty,
                                          s.frequency_penalty, s.repetition_penalty)))
            seq.append(nxt)
            seen[nxt] += 1
        out.append(seq[len(p):])
    return out


def test_verified_equals_ar_under_penalties_on_the_demo_model(demo):
    from decode.static.static_batch import generate
    config, params, prompts = demo
    run = lambda **kw: generate(params, config, prompts, DecodeConfig(max_new_tokens=NEW, **kw),
                                capacity=256).tokens
    ar = run(method="ar", **PENALTIES)
    assert ar != run(method="ar"), "the penalties change the demo model's greedy output"
    assert ar == reference_ar(config, params, prompts, Sampling(**PENALTIES))
    for window, refill in ((4, "before"), (8, "after")):
        assert run(method="verified", window=window, refill=refill, **PENALTIES) == ar, \
            (window, refill)
    # every fill of the window methods reads the adjusted logits: a banned token never appears
    banned = run(method="streaming", window=8)[1][0]
    for method in ("streaming", "block"):
        out = run(method=method, window=8, logit_bias={str(banned): -100})
        assert all(banned not in row for row in out), method


def test_bad_values_are_refused_by_name(demo):
    from tests import plans
    config, params, _ = demo
    for bad, field in ((dict(presence_penalty=2.5), "presence_penalty"),
                       (dict(frequency_penalty=-3), "frequency_penalty"),
                       (dict(repetition_penalty=0), "repetition_penalty"),
                       (dict(min_p=1.5), "min_p"),
                       (dict(logit_bias={"x": 1}), "logit_bias"),
                       (dict(logit_bias={"1": 101}), "logit_bias"),
                       (dict(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias")):
        with pytest.raises(DecodeConfigError) as e:
            Sampling(**bad)
        assert e.value.field == field and field in str(e.value), (bad, str(e.value))
    dec = plans.decoder(params, config, method="ar", slots=2, capacity=64)
    with pytest.raises(DecodeConfigError, match=rf"logit_bias: token id {config.vocab_size} is "
                                                r"outside the vocabulary") as e:
        dec.check_request(Request(prompt=(1, 2), logit_bias={str(config.vocab_size): 1.0}))
    assert e.value.field == "logit_bias"


def test_a_constraint_wins_over_a_negative_bias_and_the_request_is_warned(demo, caplog):
    """A constraint and a negative logit_bias in one request: the constraint wins (documented),
    and the Batcher logs one warning for the request; a positive bias or no constraint: none."""
    import logging

    from decode.constraints.backends import compile_for
    from decode.constraints.spec import Constraint
    from decode.engine.runtime.batcher import Batcher
    from decode.text import load_tokenizer
    from demo.eval import DEMO_MODEL
    from tests import plans
    config, params, _ = demo
    tok = load_tokenizer(DEMO_MODEL)
    yes = compile_for(Constraint.choice(["yes"], "--choice"), tok, config.vocab_size, "auto")
    required = tok.encode("yes")[0]
    batcher = Batcher(plans.decoder(params, config, method="ar", slots=2, capacity=64))
    stops = (tok.eos_token_id if tok.eos_token_id is not None else 0,)
    with caplog.at_level(logging.WARNING, logger="decode.engine.runtime.batcher"):
        batcher.submit(Request(prompt=(1, 2), logit_bias={str(required): -100}, automaton=yes,
                               stop_token_ids=stops))
        batcher.submit(Request(prompt=(1, 2), logit_bias={str(required): 5}, automaton=yes,
                               stop_token_ids=stops))
        batcher.submit(Request(prompt=(1, 2), logit_bias={str(required): -100}))
    warned = [r.getMessage() for r in caplog.records if "logit_bias" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"request 0: logit_bias lowers token(s) "
                                                     f"{required} and a constraint"), warned
    assert "the constraint wins" in warned[0]
