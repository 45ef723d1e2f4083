"""Token choice for every decoding method: entropy (the fill rule's score), the temperature /
top-k / top-p filter in either order, and per-request random keys.

All settings are per-row runtime arrays ([B]), so requests with different settings share one
compiled program. Two orders of the filter exist (`sampling_order`):

  filter_first  top-k, then top-p on the untempered logits, then the temperature: the official
                WeDLM engine's `Sampler.sample_tokens` (Tencent/WeDLM), the default here so that a
                model moved from that engine samples the same distribution with the same settings;
  temper_first  the temperature first, then top-k and top-p on the tempered logits: the order of
                transformers and vLLM.

Top-k is unchanged by the temperature (a monotone map); top-p is not, so the two orders keep
different nucleus sets whenever temperature != 1 and top_p < 1. Greedy rows (temperature 0) take
the argmax and ignore top-k / top-p in both orders. Entropy for the fill rule is always taken on
the raw logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LogitStats(NamedTuple):
    greedy: jnp.ndarray     # [B, S] int32: the argmax
    lse: jnp.ndarray        # [B, S] float32: log Z, the log-softmax's normaliser
    entropy: jnp.ndarray    # [B, S] float32 (nats)


def logit_stats(logits: jnp.ndarray) -> LogitStats:
    """What a step reads off a forward's logits [B, S, V], in two passes over the vocabulary:
    the argmax (whose value is the max), then one exp pass giving both log Z and the entropy in
    nats, H = log Z - sum(e * x') / Z with x' = x - max(x), e = exp(x'), Z = sum(e) (the fill
    rule's score). The float32 logits of a window are the step's largest temporary; separate
    max, logsumexp and entropy reductions read them five times."""
    x = logits.astype(jnp.float32)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    top = jnp.take_along_axis(x, greedy[..., None], axis=-1)                     # the max
    xm = x - top
    e = jnp.exp(xm)
    z = jnp.sum(e, axis=-1)
    lz = jnp.log(z)
    return LogitStats(greedy, top[..., 0] + lz, lz - jnp.sum(e * xm, axis=-1) / z)


def token_logprobs(logits: jnp.ndarray, tokens: jnp.ndarray, top_n: int, want=None, lse=None):
    """The log-probabilities under softmax(logits) (the model's own distribution, before any
    temperature or filter: what vLLM reports by default) of `tokens` [B, S] and of the `top_n`
    likeliest tokens: (lp [B, S], top_ids [B, S, top_n], top_lp [B, S, top_n]); top_n 0 gives
    empty top arrays (a static width: the decode state carries them, docs/algorithm.md §6). The
    top-n search over the vocabulary runs only when some row `want`s it ([B] bool; zeros else).
    `lse`: log Z when already known (`logit_stats`), else computed here."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1) if lse is None else lse
    lp = jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0] - lse
    if not top_n:
        return lp, jnp.zeros(tokens.shape + (0,), jnp.int32), jnp.zeros(tokens.shape + (0,), jnp.float32)

    def top(_):
        vals, ids = jax.lax.top_k(x, top_n)
        return ids.astype(jnp.int32), vals - lse[..., None]

    def none(_):
        return (jnp.zeros(tokens.shape + (top_n,), jnp.int32),
                jnp.zeros(tokens.shape + (top_n,), jnp.float32))

    ids, vals = top(None) if want is None else jax.lax.cond(jnp.any(want), top, none, None)
    return lp, ids, vals


def _per_row(value, like: jnp.ndarray) -> jnp.ndarray:
    """A [B] array of settings (or a scalar), shaped to broadcast against `like` ([B, ..., V])."""
    a = jnp.asarray(value)
    return a.reshape(a.shape + (1,) * (like.ndim - a.ndim)) if a.ndim else a


def filter_logits(logits: jnp.ndarray, settings) -> jnp.ndarray:
    """The sampling distribution's logits: removed tokens get -inf. `logits` [B, ..., V];
    `settings` the decode state's SlotSettings (decode.engine.step.state: one value per row [B]; top_k 0
    and top_p 1 are off; `temper_first` picks the order, see the module docstring)."""
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    t = _per_row(jnp.maximum(jnp.asarray(settings.temperature, jnp.float32), 1e-6), x)
    k = _per_row(settings.top_k, x)
    p = _per_row(settings.top_p, x)
    tf = _per_row(settings.temper_first, x)
    x = jnp.where(tf, x / t, x)
    desc = -jnp.sort(-x, axis=-1)
    k = jnp.where(k > 0, jnp.minimum(k, v), v)
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)), axis=-1)
    in_k = jnp.arange(v) < k
    desc = jnp.where(in_k, desc, -jnp.inf)
    prob = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(prob, axis=-1) - prob          # mass strictly before each sorted token
    keep = (before < p) & in_k
    thresh = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    # min-p: a token's probability at least min_p x the likeliest one's, in the same domain
    min_p = jnp.log(_per_row(settings.min_p, x).astype(jnp.float32))          # 0: -inf, off
    x = jnp.where((x < kth) | (x < thresh) | (x - desc[..., :1] < min_p), -jnp.inf, x)
    return jnp.where(tf, x, x / t)


def penalty_rows(settings) -> jnp.ndarray:
    """[B] bool: the rows whose logits a logit bias or a penalty changes."""
    return (jnp.any(settings.bias_ids >= 0, axis=-1) | (settings.presence_penalty != 0)
            | (settings.frequency_penalty != 0) | (settings.repetition_penalty != 1))


def bias_rows(settings, v: int) -> jnp.ndarray:
    """[B, V] f32: each row's logit_bias as a dense row. The entries come sorted with the padding
    (id -1) last, so a loop over as many entries as the longest bias in the batch builds it by
    comparisons (no scatter: XLA's TPU cost model cannot price one)."""
    vocab = jnp.arange(v, dtype=jnp.int32)[None, :]
    ids, vals = jnp.asarray(settings.bias_ids), jnp.asarray(settings.bias_values)

    def add(j, acc):
        return acc + jnp.where(vocab == ids[:, j, None], vals[:, j, None], 0.0)

    n = jnp.max(jnp.sum(ids >= 0, axis=-1))
    return jax.lax.fori_loop(0, n, add, jnp.zeros((ids.shape[0], v), jnp.float32))


def seen_counts(counts: jnp.ndarray, tok: jnp.ndarray, before: jnp.ndarray) -> jnp.ndarray:
    """[B, S, V] int32: per slot of a forward, how often each token was generated before it:
    the row's committed counts [B, V] plus the window's tokens `tok` [B, W] that slot reads
    (`before` [B, S, W] bool: slot s reads window token w). Built as W elementwise adds, which
    the compiler fuses into the consumer (the adjusted argmax): a one-hot contraction made
    [B, S, V] arrays the step allocated even with no penalty set (BENCHMARKS.md section 15)."""
    vocab = jnp.arange(counts.shape[-1], dtype=jnp.int32)
    seen = counts[:, None, :]
    for w in range(tok.shape[1]):
        seen = seen + (before[:, :, w, None] & (tok[:, w, None, None] == vocab)).astype(jnp.int32)
    return seen


def adjust_logits(logits: jnp.ndarray, settings, seen: jnp.ndarray) -> jnp.ndarray:
    """The logits a request chooses from: the model's [B, S, V] with its `logit_bias` added and
    its repetition, frequency and presence penalties applied over `seen` [B, S, V] (the tokens
    generated before each slot, `seen_counts`), as vLLM and OpenAI define them: a seen token's
    positive logit divided by the repetition penalty, a negative one multiplied; then
    - frequency x count - presence x [count > 0]. Every setting off leaves the logits unchanged."""
    x = logits.astype(jnp.float32)
    b, v = x.shape[0], x.shape[-1]
    x = x + bias_rows(settings, v).reshape((b,) + (1,) * (x.ndim - 2) + (v,))
    r = _per_row(settings.repetition_penalty, x)
    seen_f = seen.astype(jnp.float32)
    x = jnp.where(seen > 0, jnp.where(x > 0, x / r, x * r), x)
    return (x - _per_row(settings.frequency_penalty, x) * seen_f
            - _per_row(settings.presence_penalty, x) * (seen > 0))


def row_keys(seed: jnp.ndarray, steps: jnp.ndarray) -> jnp.ndarray:
    """One key per row from the request's own seed and its own step count: a request's draws
    depend on nothing else (not its slot, not the other requests)."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, steps)


def adjusted_greedy(logits: jnp.ndarray, settings, seen, greedy: jnp.ndarray) -> jnp.ndarray:
    """The argmax of the adjusted logits (`adjust_logits`) for the rows a bias or a penalty
    changes, `greedy` (the model's argmax) for the others; `seen`: () -> the [B, S, V] counts
    (`seen_counts`), built only when some row needs them (`lax.cond`)."""
    rows = penalty_rows(settings)

    def adjusted(_):
        g = jnp.argmax(adjust_logits(logits, settings, seen()), axis=-1).astype(jnp.int32)
        return jnp.where(rows.reshape(rows.shape + (1,) * (g.ndim - 1)), g, greedy)

    return jax.lax.cond(jnp.any(rows), adjusted, lambda _: greedy, None)


def choose_tokens(logits: jnp.ndarray, keys: jnp.ndarray, settings,
                  sampling: bool = True, greedy=None, seen=None) -> jnp.ndarray:
    """logits [B, S, V] -> token ids [B, S]: the argmax for greedy rows (temperature 0), a draw
    from the filtered distribution for the others, both of the logits adjusted by the rows'
    logit bias and penalties (`seen`: () -> the counts `seen_counts`; None: no adjustment). The
    sampling work runs only when some row samples (`lax.cond`), so an all-greedy batch pays for
    the argmax alone; with `sampling` False (a static flag: no request may sample) the program
    holds the argmax only. `greedy`: the model's argmax when already known (`logit_stats`)."""
    if greedy is None:
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if seen is not None:
        greedy = adjusted_greedy(logits, settings, seen, greedy)
    if not sampling:
        return greedy
    sampled_rows = settings.temperature > 0

    def draw(_):
        x = filter_logits(logits if seen is None else adjust_logits(logits, settings, seen()),
                          settings)
        d = jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(keys, x)
        return jnp.where(sampled_rows[:, None], d.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(sampled_rows), draw, lambda _: greedy, None)
