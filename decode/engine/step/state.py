"""The decode state: registered pytrees with documented shapes, donated to every compiled call.

B = slots (rows of the batch), S = slots per forward (AR 1; streaming, block and verified W with
refill 'after', 2W with refill 'before'), R = cache rows, V = vocabulary.
"""

from __future__ import annotations

import dataclasses

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from decode.config import Sampling
from decode.options import OnDevice, device_fields

# a token a constraint forbids has its logit at half the dtype's lowest value (decode.engine.step.guide):
# its log-probability lies far below this, and it is never listed among the top alternatives
FORBIDDEN_LOGPROB = -1e30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request(Sampling):
    """One request: its prompt (token ids, at least one) and its Sampling settings (checked on
    construction; `Decoder.check_request` checks them against the Decoder: vocabulary, capacity)."""
    prompt: tuple
    # alternatives wanted per generated token (<= the Decoder's: Decoder.check_request)
    top_logprobs: int = dataclasses.field(default=0, metadata=dict(
        device=(OnDevice("bool", "want_top", encode=lambda v: v > 0),)))
    automaton: Any = None           # a compiled constraint (decode.constraints.automaton), or None
    automaton_state: int = 0        # its state after the tokens already emitted (a readmission)
    adapter: int = 0                # its row of the LoRA adapter table (0: the base model;
                                    # decode.engine.runtime.adapters names the rows)

    def bias_warning(self, who: str) -> str | None:
        """A constraint and a negative logit_bias together: the constraint wins (a token it
        requires is emitted whatever its bias; the bias only ranks the tokens it allows). The
        words the doors log once per request (`who` names it), else None."""
        lowered = [t for t, b in self.logit_bias if b < 0]
        if self.automaton is None or not lowered:
            return None
        return (f"{who}: logit_bias lowers token(s) {', '.join(map(str, lowered[:8]))}"
                f"{' ...' if len(lowered) > 8 else ''} and a constraint shapes the output: the "
                "constraint wins (a token it requires is emitted whatever its bias)")


@struct.dataclass
class KVCache:
    """The prefix KV cache and how much of it is final.

    layers: the model's cache pytree (`model.init_kv_cache`): keys and values [.., B, R, kv_heads,
            head_dim]; rows 0..length[b]-1 of row b are final (committed), rows past them hold the
            current window's or stale K/V that nothing reads.
    length: [B] int32, the committed length n of each row (prompt plus committed tokens).
    """
    layers: Any
    length: jax.Array


# ------------------------------------------------------------- the settings on the device
#
# A request's runtime settings travel to the decode loop as one value per slot: the fields of
# Request (its Sampling options) defined with `device=OnDevice(...)` (decode/options.py), in
# definition order. `OFF` holds a free slot's values (each option's default, encoded) and
# `settings_rows` is the one constructor.

DEVICE_FIELDS = device_fields(Request)        # [(option name, default, OnDevice)]


def _encode(d: OnDevice, value):
    return d.encode(value) if d.encode is not None else value


OFF = {d.name or name: _encode(d, default) for name, default, d in DEVICE_FIELDS}


def _settings_type():
    doc = ("Per-request runtime settings, one value per slot (no recompile per request): "
           + ", ".join(f"{d.name or n} [B{', %d' % d.width if d.width else ''}] {d.dtype}"
                       for n, _, d in DEVICE_FIELDS) + " (decode.options.OnDevice).")
    names = {d.name or n: jax.Array for n, _, d in DEVICE_FIELDS}
    return struct.dataclass(type("SlotSettings", (), {"__annotations__": names, "__doc__": doc,
                                                  "__module__": __name__}))


SlotSettings = _settings_type()


def settings_rows(requests) -> SlotSettings:
    """The SlotSettings of NumPy arrays for len(requests) slots: row i holds requests[i]'s values
    (a Request, or any Sampling: options it lacks are off), a free slot's (OFF) where it is None."""
    b, out = len(requests), {}
    for name, _, d in DEVICE_FIELDS:
        key = d.name or name
        a = np.empty((b, d.width) if d.width else (b,), np.dtype(d.dtype))
        for i, r in enumerate(requests):
            a[i] = OFF[key] if r is None or not hasattr(r, name) else _encode(d, getattr(r, name))
        out[key] = a
    return SlotSettings(**out)


@struct.dataclass
class TokenLogProbs:
    """Log-probabilities of tokens (docs/algorithm.md §6), per slot: for the window, those of the
    filled slots' tokens under the forward that chose them; for emitted tokens, the same carried
    to the step that commits them. K = the Decoder's `top_logprobs` (a static width, 0: none).

    lp:     [B, S] f32 the token's log-probability (the model's distribution, unfiltered)
    top_ids [B, S, K] i32 / top_lp [B, S, K] f32: the K likeliest tokens of that distribution
    """
    lp: jax.Array
    top_ids: jax.Array
    top_lp: jax.Array

    @staticmethod
    def zeros(b: int, s: int, k: int) -> "TokenLogProbs":
        """Host zeros for b rows of s slots (a free state, a new request's window)."""
        return TokenLogProbs(lp=np.zeros((b, s), np.float32), top_ids=np.zeros((b, s, k), np.int32),
                             top_lp=np.zeros((b, s, k), np.float32))

    def where(self, sel, other: "TokenLogProbs") -> "TokenLogProbs":
        """self where `sel` [B, S], else `other`."""
        return jax.tree.map(lambda a, b: jnp.where(sel.reshape(sel.shape + (1,) * (a.ndim - 2)), a, b),
                            self, other)

    def take(self, src) -> "TokenLogProbs":
        """Slots gathered along axis 1 by `src` [B, S'] (a slide or a reorder)."""
        return jax.tree.map(lambda a: jnp.take_along_axis(
            a, src.reshape(src.shape + (1,) * (a.ndim - 2)), axis=1), self)

    def head(self, n: int) -> "TokenLogProbs":
        return jax.tree.map(lambda a: a[:, :n], self)


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries, per slot.

    cache:    KVCache (its `length` is the committed length n).
    tok:      [B, S] i32 window tokens in logical order (position n + i); AR and verified: slot 0
              holds the pending token (known, emitted or prompt, K/V not yet in the cache).
    filled:   [B, S] bool, slot i holds a predicted token (False: [MASK]).
    end:      [B] i32 the row's budget: min(prompt + max_new_tokens, capacity) positions.
    done:     [B] bool, finished (or free) slots; they stop changing.
    steps:    [B] i32 forwards while live (also the request's random-stream counter).
    n_fwd:    [B] i32 token slots those forwards processed for the row.
    count:    [B] i32 tokens emitted.
    accepted: [B] i32 verified drafts accepted; rejected: [B] i32 drafts that failed verification.
    lps:      TokenLogProbs [B, S, ..] of the window's filled slots (streaming and block; AR and
              verified read them from the step's own forward and leave these as they are).
    q:        [B, S, V] f32 or None: verified sampling's draft distributions (logical order).
    seen:     [B, V] i32 how often the row generated each token (emitted; its logit bias and
              penalties read it, decode.engine.step.sampling.adjust_logits).
    settings: SlotSettings.
    guide:    decode.engine.step.guide.Guide or None: the slots' constraint automata (docs/algorithm.md
              §7); None when no request of the state has had one (no constraint code compiled).
    lora:     [B] i32 each slot's row of the LoRA adapter table (0: the base), or None when the
              Decoder serves no adapters (no adapter code compiled; wedlm_jax.lora.table).
    """
    cache: KVCache
    tok: jax.Array
    filled: jax.Array
    end: jax.Array
    done: jax.Array
    steps: jax.Array
    n_fwd: jax.Array
    count: jax.Array
    accepted: jax.Array
    rejected: jax.Array
    lps: TokenLogProbs
    seen: jax.Array
    settings: SlotSettings
    q: Any = None
    guide: Any = None
    lora: Any = None

    @property
    def n(self) -> jax.Array:
        return self.cache.length


@struct.dataclass
class Prefix:
    """One prefilled request, ready to `insert` into a slot (JetStream's prefill result).

    kv:    the model's cache pytree with batch 1 and Pb (the prompt bucket) rows.
    row:   a DecodeState of batch 1 without cache layers (kv lives in `kv`): the request's first
           window, budget and settings.
    """
    kv: Any
    row: DecodeState


def keep_if_done(done: jax.Array, new, old):
    """Rows that are done keep their old values (for any [B, ...] array)."""
    d = done.reshape(done.shape + (1,) * (new.ndim - done.ndim))
    return jnp.where(d, old, new)


# ------------------------------------------------------------------ host-side rows (NumPy)

def free_rows(static, mask_id: int) -> DecodeState:
    """Every slot of a Decoder of `static` free, as NumPy arrays, without cache layers."""
    b, s = static.slots, static.span
    zeros = np.zeros((b,), np.int32)
    settings = settings_rows([None] * b)
    return DecodeState(
        cache=KVCache(layers=None, length=zeros.copy()),
        tok=np.full((b, s), mask_id, np.int32), filled=np.zeros((b, s), bool),
        end=zeros.copy(), done=np.ones((b,), bool), steps=zeros.copy(), n_fwd=zeros.copy(),
        count=zeros.copy(), accepted=zeros.copy(), rejected=zeros.copy(),
        lps=TokenLogProbs.zeros(b, s, static.spec.top_logprobs), settings=settings,
        seen=np.zeros((b, static.config.vocab_size), np.int32),
        q=(np.zeros((b, s, static.config.vocab_size), np.float32) if static.keep_q else None),
        lora=np.zeros((b,), np.int32) if static.max_loras else None)


def request_row(static, r, mask_id: int, capacity: int):
    """(prompt ids to prefill, prefill length, the request's first row as a batch-1 DecodeState
    of NumPy arrays without cache layers) of a checked Request `r`. Streaming / block prefill
    the whole prompt and start with a window of masks; AR / verified hold the last prompt token
    as the pending one."""
    method = static.spec.method
    plen = len(r.prompt)
    end = min(plen + r.max_new_tokens, capacity)
    s = static.span
    tok = np.full((1, s), mask_id, np.int32)
    filled = np.zeros((1, s), bool)
    if method in ("ar", "verified"):
        n0, tok[0, 0] = plen - 1, r.prompt[-1]
        filled[0, 0] = method == "verified"
        done = n0 + 1 >= end
    else:
        n0 = plen
        done = n0 >= end
    one = lambda v, dt: np.asarray([v], dt)
    settings = settings_rows([r])
    zero = one(0, np.int32)
    row = DecodeState(
        cache=KVCache(layers=None, length=one(n0, np.int32)), tok=tok, filled=filled,
        end=one(end, np.int32), done=one(done, bool), steps=zero, n_fwd=zero, count=zero,
        accepted=zero, rejected=zero, lps=TokenLogProbs.zeros(1, s, static.spec.top_logprobs),
        settings=settings, seen=np.zeros((1, static.config.vocab_size), np.int32),
        q=(np.zeros((1, s, static.config.vocab_size), np.float32) if static.keep_q else None),
        lora=one(r.adapter, np.int32) if static.max_loras else None)
    return r.prompt, n0, row


@dataclasses.dataclass
class ResultTokens:
    """What one `generate` call produced: tokens [B, k, E] with counts [B, k] (slot b emitted
    tokens[b, i, :counts[b, i]] at its i-th step of the call), `steps` loop iterations run, and
    `done` [B] the slots finished (or free) after the call, fetched with the tokens; `logprobs`
    (TokenLogProbs [B, k, E, ..] of NumPy arrays) the emitted tokens' log-probabilities."""
    tokens: np.ndarray
    counts: np.ndarray
    steps: int
    done: np.ndarray
    logprobs: TokenLogProbs | None = None

    def _emitted(self, slot: int):
        return [(i, j) for i in range(self.steps) for j in range(int(self.counts[slot, i]))]

    def new_ids(self, slot: int) -> list[int]:
        return [int(self.tokens[slot, i, j]) for i, j in self._emitted(slot)]

    def new_logprobs(self, slot: int, top_n: int = 0) -> list[tuple[float, dict]]:
        """Per new id of `slot`: (its log-probability, {token id: log-probability} of the `top_n`
        likeliest tokens, best first; top_n at most the request's `top_logprobs`). Tokens a
        constraint forbade (probability 0: below FORBIDDEN_LOGPROB) are left out."""
        lp = self.logprobs
        return [(float(lp.lp[slot, i, j]),
                 {int(t): float(v) for t, v in zip(lp.top_ids[slot, i, j, :top_n],
                                                   lp.top_lp[slot, i, j, :top_n])
                  if v > FORBIDDEN_LOGPROB})
                for i, j in self._emitted(slot)]
