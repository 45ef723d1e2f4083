"""Constrained decoding on the device: each slot's token automaton (decode.constraints.automaton)
read inside the decode loop, no host round trip per step (docs/algorithm.md §7).

A slot's `Guide` row holds its automaton's tables (padded to one shape, DEVICE_TABLE) and the state
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

from decode.config import DEVICE_TABLE as TABLE
from decode.engine.step.host_guide import TICKETS, host_read, unpack_bits
from decode.engine.step.state import keep_if_done



@struct.dataclass
class Guide:
    """Per slot: state [B] i32, on [B] bool, klass [B, V] i32, trans [B, N, C] i32 (N, C:
    DEVICE_TABLE): the device tables. host [B] bool, ticket [B] i32: the slot's
    parser on the host (decode.engine.step.host_guide), told the tokens committed in the step before
    (recent [B, S], recent_k [B]); the step asks the host only when a live slot uses it.
    parsers (static): whether the programs hold the host call at all (False: device tables only,
    and no host callback, so the programs can be kept in JAX's persistent compile cache)."""
    state: jax.Array
    on: jax.Array
    klass: jax.Array
    trans: jax.Array
    host: jax.Array
    ticket: jax.Array
    recent: jax.Array
    recent_k: jax.Array
    parsers: bool = struct.field(pytree_node=False, default=True)


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


def mask(logits, g: Guide, states, bits=None, at=None):
    """logits [B, P, V] with the tokens not allowed in `states` [B, P] at a huge negative value
    (finite: the entropy's sum of p * log p stays a number; their probability is exactly 0);
    with host `bits` [B, P or 1, words], also those its parser forbids at positions `at`
    [B, P] of host slots. A step where no slot holds a constraint leaves the logits alone
    without computing the mask (a server's state keeps its Guide rows between constraints)."""
    low = jnp.asarray(jnp.finfo(logits.dtype).min / 2, logits.dtype)

    def restrict(lg):
        ok = allowed(g, states)
        if bits is not None:
            apply = at & g.host[:, None]
            ok = ok & (unpack_bits(bits, lg.shape[-1]) | ~apply[..., None])
        return jnp.where(ok, lg, low)
    return jax.lax.cond(jnp.any(g.on | g.host), restrict, lambda lg: lg, logits)


def _leading(x):
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=1), axis=1)


def recheck(st):
    """(state with the first rejected slot of the leading filled run and the slots after it back
    at [MASK], the reading: the states along the window [B, S+1] and the host slots' bits after
    their accepted run); (st, None) without a Guide."""
    g = st.guide
    if g is None:
        return st, None
    states = walk(g, st.tok)
    ok = (states[:, 1:] >= 0) | ~g.on[:, None]
    run = _leading(st.filled)
    idx = jnp.arange(st.tok.shape[1])[None, :]
    k_ok, bits = host_read(g, st.tok, run, 1, ~st.done)
    ok = ok & ((idx < k_ok[:, None]) | ~g.host[:, None])
    first_bad = _leading(ok | ~st.filled)            # first slot not ok among the filled ones
    reject = (idx >= first_bad[:, None]) & (first_bad < run)[:, None]
    return st.replace(filled=st.filled & ~reject), (states, bits)


def mask_head(logits, st, reading, filled, inv):
    """logits [B, S, V] (physical order) with the first [MASK] after the leading filled run
    restricted to the tokens its known state allows."""
    if reading is None:
        return logits
    states, bits = reading
    lead = _leading(filled)
    s_lead = jnp.take_along_axis(states, lead[:, None], axis=1)       # [B, 1]
    idx = jnp.arange(filled.shape[1])[None, :]
    logical = jnp.where(idx == lead[:, None], s_lead, -1)
    rows = jnp.arange(filled.shape[0])[:, None]
    physical = jnp.full_like(logical, -1).at[rows, inv].set(logical)
    at = jnp.zeros_like(filled).at[rows, inv].set(idx == lead[:, None])
    return mask(logits, st.guide, physical, bits, at)


def fill_head(sel, st, remaining, idx, c):
    """`sel` [B, S] with each constrained slot's head (the first [MASK] after the committed run,
    read under its mask) always filled: the next step then commits at least one token, as
    constrained AR would, however far the drafts stray from the constraint."""
    g = st.guide
    if g is None:
        return sel
    return sel | ((idx == c[:, None]) & remaining & (g.on | g.host)[:, None])


def mask_rows(logits, st):
    """AR: logits [B, 1, V] restricted by each slot's state."""
    g = st.guide
    if g is None:
        return logits
    _, bits = host_read(g, st.tok, jnp.zeros_like(st.n), 1, ~st.done)
    return mask(logits, g, g.state[:, None], bits, jnp.ones(logits.shape[:2], bool))


def mask_run(logits, st, c):
    """Verified: the AR reading at slot p < c (physical = logical inside the leading run)
    restricted by the state after slots 0..p (the pending token and the drafts before p + 1).
    Returns (logits, states [B, S]) (states None without a Guide)."""
    g = st.guide
    if g is None:
        return logits, None
    states = walk(g, st.tok[:, 1:])                                    # [B, S]
    idx = jnp.arange(states.shape[1])[None, :]
    _, bits = host_read(g, st.tok[:, 1:], jnp.maximum(c - 1, 0), states.shape[1], ~st.done)
    return mask(logits, g, jnp.where(idx < c[:, None], states, -1), bits,
                idx < c[:, None]), states


def _recorded(guide, st, recent, k):
    """`guide` with the host slots told the tokens committed this step: recent [B, S], the
    first k [B] (none for a slot already done). `recent` keeps the Guide's width (a smaller rung
    of the window ladder steps with fewer slots: the rest is padding)."""
    width = guide.recent.shape[1]
    if recent.shape[1] < width:
        recent = jnp.pad(recent, ((0, 0), (0, width - recent.shape[1])))
    return guide.replace(recent=recent.astype(jnp.int32),
                         recent_k=jnp.where(st.done, 0, k).astype(jnp.int32))


def committed(new, st, states, k):
    """`new` with each live slot's automaton state moved `k` [B] tokens along `states` (the
    reading of `recheck`), the host slots told the window's first k tokens."""
    if states is None:
        return new
    states = states[0]
    s = jnp.take_along_axis(states, k[:, None], axis=1)[:, 0]
    g = new.guide.replace(state=keep_if_done(st.done, s, st.guide.state))
    return new.replace(guide=_recorded(g, st, st.tok, k))


def advanced(new, st, states, k, tok):
    """Verified and AR: the state after `k` [B] slots along `states` (or the slot's state when
    `states` is None) and then the token `tok` [B]; the host slots told the drafts 1..k and
    then `tok`."""
    g = st.guide
    if g is None:
        return new
    s = g.state if states is None else jnp.take_along_axis(states, k[:, None], axis=1)[:, 0]
    s = next_state(g, s, tok)
    k = jnp.zeros_like(tok) if k is None else k
    nxt = jnp.concatenate([st.tok[:, 1:], st.tok[:, :1]], axis=1)
    idx = jnp.arange(nxt.shape[1])[None, :]
    recent = jnp.where(idx == k[:, None], tok[:, None], nxt)
    g2 = new.guide.replace(state=keep_if_done(st.done, s, g.state))
    return new.replace(guide=_recorded(g2, st, recent, k + 1))


# ----------------------------------------------------------------------------- on the host

def is_host(compiled) -> bool:
    return getattr(compiled, "backend", "device") == "host"


def free_guide(b: int, vocab: int, span: int, parsers: bool = True) -> Guide:
    """b rows with no constraint, as NumPy arrays (the tables at their one shape, TABLE)."""
    n, c = TABLE
    z = lambda *shape: np.zeros(shape, np.int32)   # noqa: E731
    return Guide(state=z(b), on=np.zeros((b,), bool), klass=z(b, vocab), trans=z(b, n, c),
                 host=np.zeros((b,), bool), ticket=z(b), recent=z(b, span), recent_k=z(b),
                 parsers=parsers)


def request_guide(compiled, stop_ids, vocab: int, span: int, start=0) -> Guide:
    """A request's row (batch 1, NumPy): an automaton's tables padded to TABLE, its stop tokens
    allowed in accepting states only, the state `start` (0: the initial state); or a host
    grammar's parser, opened after the tokens `start` (a readmission's)."""
    g = free_guide(1, vocab, span)
    if is_host(compiled):
        g.host[0] = True
        g.ticket[0] = TICKETS.open(compiled, stop_ids, start or ())
        return g
    if compiled.num_states > TABLE[0] or compiled.num_classes > TABLE[1]:
        raise ValueError(f"an automaton of {compiled.num_states} states x "
                         f"{compiled.num_classes} classes is above the device tables' {TABLE}")
    klass = compiled.with_stops(stop_ids)
    g.klass[0, :len(klass)] = klass
    g.trans[0] = -1
    g.trans[0, :compiled.num_states, :compiled.num_classes] = compiled.trans
    g.on[0] = True
    g.state[0] = start
    return g


def attach(row, compiled, stop_ids, vocab: int, guided: bool = False, start=0):
    """A request's first row (batch 1) with its Guide row: its constraint's, or none (a free row
    with `guided`, for a batch where others have one; unchanged otherwise)."""
    span = row.tok.shape[1]
    if compiled is None:
        return row.replace(guide=free_guide(1, vocab, span)) if guided else row
    return row.replace(guide=request_guide(compiled, stop_ids, vocab, span, start))


def with_guide(state, vocab: int, parsers: bool = True):
    """`state` with free Guide rows if it has none (a Decoder compiles its guided programs
    once, with the server's others: a constraint then never compiles on a request's clock)."""
    if state.guide is not None:
        return state
    xp = jnp if isinstance(state.done, jax.Array) else np
    free = free_guide(state.done.shape[0], vocab, state.tok.shape[1], parsers)
    return state.replace(guide=jax.tree.map(xp.asarray, free))


def conform(state, row, vocab: int):
    """(state, row) both with Guides when either has one (the one that lacks it gets free rows:
    a state that gains one compiles its guided programs once); unchanged when neither has."""
    if state.guide is None and row.guide is None:
        return state, row
    state, row = with_guide(state, vocab), with_guide(row, vocab)
    return state, row.replace(guide=row.guide.replace(parsers=state.guide.parsers))
