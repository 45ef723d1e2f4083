"""The decode state: registered pytrees with documented shapes, donated to every compiled call.

B = slots (rows of the batch), S = slots per forward (AR 1; streaming, block and verified W with
refill 'after', 2W with refill 'before'), R = cache rows, V = vocabulary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


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


@struct.dataclass
class Settings:
    """Per-request runtime settings, one value per slot (no recompile per request)."""
    tau: jax.Array            # [B] f32 entropy threshold of the fill rule
    lam: jax.Array            # [B] f32 distance penalty lambda
    temperature: jax.Array    # [B] f32 (0: greedy)
    top_k: jax.Array          # [B] i32 (0: off)
    top_p: jax.Array          # [B] f32 (1: off)
    temper_first: jax.Array   # [B] bool: sampling order (decode.sampling)
    stop_ids: jax.Array       # [B, MAX_STOP_IDS] i32, padded with -1
    seed: jax.Array           # [B] u32 the request's seed
    want_top: jax.Array       # [B] bool: the request wants top log-probability alternatives


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
    settings: Settings.
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
    settings: Settings
    q: Any = None

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
