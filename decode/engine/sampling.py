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

from decode.config import SAMPLING_ORDERS  # noqa: E402  (defined once, in decode.config)


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
    `settings` the decode state's Settings (decode.engine.state: one value per row [B]; top_k 0
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
    x = jnp.where((x < kth) | (x < thresh), -jnp.inf, x)
    return jnp.where(tf, x, x / t)


def row_keys(seed: jnp.ndarray, steps: jnp.ndarray) -> jnp.ndarray:
    """One key per row from the request's own seed and its own step count: a request's draws
    depend on nothing else (not its slot, not the other requests)."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, steps)


def choose_tokens(logits: jnp.ndarray, keys: jnp.ndarray, settings,
                  sampling: bool = True, greedy=None) -> jnp.ndarray:
    """logits [B, S, V] -> token ids [B, S]: the argmax for greedy rows (temperature 0), a draw
    from the filtered distribution for the others. The sampling work runs only when some row
    samples (`lax.cond`), so an all-greedy batch pays for the argmax alone; with `sampling`
    False (a static flag: no request may sample) the program holds the argmax only. `greedy`:
    the argmax when already known (`logit_stats`)."""
    if greedy is None:
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampling:
        return greedy
    sampled_rows = settings.temperature > 0

    def draw(_):
        x = filter_logits(logits, settings)
        d = jax.vmap(lambda k, l: jax.random.categorical(k, l, axis=-1))(keys, x)
        return jnp.where(sampled_rows[:, None], d.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(sampled_rows), draw, lambda _: greedy, None)
