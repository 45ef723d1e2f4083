"""Constrained decoding on the device: each slot's token automaton (decode.constraints.automaton)
read inside the decode loop, no host round trip per step (docs/algorithm.md §7).

A slot's `Guide` row holds its automaton's tables (padded to the state's bucket) and the state
reached after its committed tokens (AR and verified: after the pending token too). A token t is
allowed in state s iff trans[s, klass[t]] >= 0. Rows with `on` False (no constraint) and states
< 0 (past a rejected draft: nothing there is committed) mask nothing, so a slot's constraint
never touches another slot's tokens.

What each method does with it (the steps call these; with no Guide in the state they return
their inputs and the programs hold no constraint code):

  streaming / block  `recheck` before the forward: walk the window's leading filled run from the
                     committed state; the first slot the automaton rejects and every slot after
                     it go back to [MASK] (they were filled beside a token that cannot stand,
                     often the same text one position off: kept, each would be rejected in
                     turn, one a step), so the step commits only the accepted run. `mask_head`: the first [MASK] after that run (its state is known) is
                     read from the allowed tokens only, so a filled head is always accepted.
  ar                 `mask_rows`: the step's distribution restricted to the allowed tokens.
  verified           `mask_run`: the AR reading at each slot of the leading run restricted by the
                     state reached along the drafts; the accept rule then compares drafts with
                     the constrained AR token, so the output is constrained AR decoding's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from decode.engine.state import keep_if_done
from wedlm_jax.buckets import pow2_at_least

MIN_BUCKET = 16


@struct.dataclass
class Guide:
    """Per slot: state [B] i32, on [B] bool, klass [B, V] i32, trans [B, N, C] i32 (N, C: the
    state's bucket, powers of two)."""
    state: jax.Array
    on: jax.Array
    klass: jax.Array
    trans: jax.Array


# ----------------------------------------------------------------------------- on the device

def next_state(g: Guide, state, tok):
    """[B] the state after token `tok` [B] from `state` [B] (-1: rejected, or already -1)."""
    cls = jnp.take_along_axis(g.klass, tok[:, None], axis=1)[:, 0]
    row = jnp.take_along_axis(g.trans, jnp.maximum(state, 0)[:, None, None], axis=1)[:, 0]
    nxt = jnp.take_along_axis(row, cls[:, None], axis=1)[:, 0]
    return jnp.where(state >= 0, nxt, -1)


def walk(g: Guide, tok):
    """[B, P+1] the states along tokens `tok` [B, P] from the slot's state (column 0)."""
    def body(s, t):
        n = next_state(g, s, t)
        return n, n
    _, states = jax.lax.scan(body, g.state, tok.T)
    return jnp.concatenate([g.state[:, None], states.T], axis=1)


def allowed(g: Guide, states):
    """[B, P, V] bool: the tokens allowed in `states` [B, P] (all where the state is < 0 or the
    row has no constraint)."""
    rows = jnp.take_along_axis(g.trans, jnp.maximum(states, 0)[..., None], axis=1)  # [B, P, C]
    ok = jnp.take_along_axis(rows, jnp.broadcast_to(
        g.klass[:, None, :], states.shape + g.klass.shape[-1:]), axis=2) >= 0
    free = (states < 0) | ~g.on[:, None]
    return ok | free[..., None]


def mask(logits, g: Guide, states):
    """logits [B, P, V] with the tokens not allowed in `states` [B, P] at a huge negative value
    (finite: the entropy's sum of p * log p stays a number; their probability is exactly 0)."""
    low = jnp.asarray(jnp.finfo(logits.dtype).min / 2, logits.dtype)
    return jnp.where(allowed(g, states), logits, low)


def _leading(x):
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=1), axis=1)


def recheck(st):
    """(state with the first rejected slot of the leading filled run and the slots after it back
    at [MASK], the states along the window [B, S+1]); (st, None) without a Guide."""
    g = st.guide
    if g is None:
        return st, None
    states = walk(g, st.tok)
    ok = (states[:, 1:] >= 0) | ~g.on[:, None]
    run = _leading(st.filled)
    idx = jnp.arange(st.tok.shape[1])[None, :]
    first_bad = _leading(ok | ~st.filled)            # first slot not ok among the filled ones
    reject = (idx >= first_bad[:, None]) & (first_bad < run)[:, None]
    return st.replace(filled=st.filled & ~reject), states


def mask_head(logits, st, states, filled, inv):
    """logits [B, S, V] (physical order) with the first [MASK] after the leading filled run
    restricted to the tokens its known state allows."""
    if states is None:
        return logits
    lead = _leading(filled)
    s_lead = jnp.take_along_axis(states, lead[:, None], axis=1)       # [B, 1]
    idx = jnp.arange(filled.shape[1])[None, :]
    logical = jnp.where(idx == lead[:, None], s_lead, -1)
    rows = jnp.arange(filled.shape[0])[:, None]
    physical = jnp.full_like(logical, -1).at[rows, inv].set(logical)
    return mask(logits, st.guide, physical)


def mask_rows(logits, st):
    """AR: logits [B, 1, V] restricted by each slot's state."""
    return logits if st.guide is None else mask(logits, st.guide, st.guide.state[:, None])


def mask_run(logits, st, c):
    """Verified: the AR reading at slot p < c (physical = logical inside the leading run)
    restricted by the state after slots 0..p (the pending token and the drafts before p + 1).
    Returns (logits, states [B, S]) (states None without a Guide)."""
    if st.guide is None:
        return logits, None
    states = walk(st.guide, st.tok[:, 1:])                             # [B, S]
    idx = jnp.arange(states.shape[1])[None, :]
    return mask(logits, st.guide, jnp.where(idx < c[:, None], states, -1)), states


def committed(new, st, states, k):
    """`new` with each live slot's automaton state moved `k` [B] tokens along `states`."""
    if states is None:
        return new
    s = jnp.take_along_axis(states, k[:, None], axis=1)[:, 0]
    return new.replace(guide=new.guide.replace(state=keep_if_done(st.done, s, st.guide.state)))


def advanced(new, st, states, k, tok):
    """Verified and AR: the state after `k` [B] slots along `states` (or the slot's state when
    `states` is None) and then the token `tok` [B]."""
    g = st.guide
    if g is None:
        return new
    s = g.state if states is None else jnp.take_along_axis(states, k[:, None], axis=1)[:, 0]
    s = next_state(g, s, tok)
    return new.replace(guide=new.guide.replace(state=keep_if_done(st.done, s, g.state)))


# ----------------------------------------------------------------------------- on the host

def bucket_of(automaton) -> tuple[int, int]:
    """The (states, classes) bucket an automaton's tables are padded to."""
    return (pow2_at_least(automaton.num_states, MIN_BUCKET),
            pow2_at_least(automaton.num_classes, MIN_BUCKET))


def free_guide(b: int, vocab: int, bucket) -> Guide:
    """b rows with no constraint, as NumPy arrays."""
    n, c = bucket
    return Guide(state=np.zeros((b,), np.int32), on=np.zeros((b,), bool),
                 klass=np.zeros((b, vocab), np.int32), trans=np.zeros((b, n, c), np.int32))


def request_guide(automaton, stop_ids, vocab: int, bucket, start: int = 0) -> Guide:
    """A request's row (batch 1, NumPy): its tables padded to `bucket`, its stop tokens allowed
    in accepting states only, the state `start` (0: the initial state)."""
    n, c = bucket
    g = free_guide(1, vocab, bucket)
    klass = automaton.with_stops(stop_ids)
    g.klass[0, :len(klass)] = klass
    g.trans[0] = -1
    g.trans[0, :automaton.num_states, :automaton.num_classes] = automaton.trans
    g.on[0] = True
    g.state[0] = start
    return g


def pad_guide(g: Guide | None, b: int, vocab: int, bucket, xp=jnp) -> Guide:
    """`g` (or no constraint for b rows) padded to `bucket` (not smaller than its own)."""
    if g is None:
        return jax.tree.map(xp.asarray, free_guide(b, vocab, bucket))
    n, c = bucket
    _, n0, c0 = g.trans.shape
    if (n0, c0) == (n, c):
        return g
    return g.replace(trans=xp.pad(g.trans, ((0, 0), (0, n - n0), (0, c - c0)),
                                  constant_values=-1))


def bucket_of_guide(g: Guide | None):
    return None if g is None else tuple(g.trans.shape[1:])


def join_buckets(*buckets):
    """The smallest bucket holding all of `buckets` (None entries ignored; None if all are)."""
    given = [b for b in buckets if b is not None]
    if not given:
        return None
    return max(b[0] for b in given), max(b[1] for b in given)


def attach(row, automaton, stop_ids, vocab: int, bucket=None, start: int = 0):
    """A request's first row (batch 1) with its Guide row (unchanged without an automaton)."""
    if automaton is None:
        return row if bucket is None else row.replace(guide=free_guide(1, vocab, bucket))
    return row.replace(guide=request_guide(automaton, stop_ids, vocab,
                                           join_buckets(bucket, bucket_of(automaton)), start))


def conform(state, row, vocab: int):
    """(state, row) with Guides of one bucket, the larger of theirs (a state or row without one
    gets rows with no constraint); both unchanged when neither has a Guide. A state whose
    bucket grows takes one compile of the programs for the new shape."""
    bs, br = bucket_of_guide(state.guide), bucket_of_guide(row.guide)
    if bs is None and br is None:
        return state, row
    b = join_buckets(bs, br)
    return (state.replace(guide=pad_guide(state.guide, state.done.shape[0], vocab, b)),
            row.replace(guide=pad_guide(row.guide, 1, vocab, b)))
