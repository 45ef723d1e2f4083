"""The host half of a Guide: slots whose constraint runs in a host parser (decode.constraints.host)
are asked once a step, from inside the compiled decode loop (`jax.experimental.io_callback`), for
how much of a token run their grammar takes and for the allowed tokens as a bitmask.

A slot's parser lives in `TICKETS` under the ticket its Guide row carries. The device tells it,
each step, the tokens the slot committed in the step before (`recent`): the parser consumes those,
so it always stands after exactly the committed tokens; what a call validates or reads ahead is
rolled back before it returns. A slot re-admitted gets a new ticket whose parser replays the
tokens it had committed.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

log = logging.getLogger(__name__)
MAX_TICKETS = 4096        # parsers kept (live slots touch theirs every step; the rest age out)


class Tickets:
    """ticket -> the slot's parser (least recently used dropped past MAX_TICKETS)."""

    def __init__(self, size: int = MAX_TICKETS):
        self.size, self.items = size, collections.OrderedDict()
        self.lock, self.next = threading.Lock(), 1

    def open(self, grammar, stop_ids, tokens=()) -> int:
        matcher = grammar.matcher(stop_ids, tuple(tokens or ()))
        with self.lock:
            t, self.next = self.next, self.next + 1
            self.items[t] = matcher
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return t

    def get(self, ticket: int):
        with self.lock:
            m = self.items.get(int(ticket))
            if m is not None:
                self.items.move_to_end(int(ticket))
            return m


TICKETS = Tickets()


@functools.cache
def executor():
    """llguidance's thread pool (one per process)."""
    import llguidance
    return llguidance.LLExecutor()


def masks_along(jobs, positions: int, words: int) -> np.ndarray:
    """[len(jobs), positions, words] int32 for jobs [(Matcher, draft)] (decode.constraints.host's
    Matcher), each draft shorter than `positions` and taken by its grammar: row p holds the tokens
    allowed after the draft's first min(p, len(draft)) tokens. All parsers' masks are computed
    together in llguidance's pool."""
    import llguidance.numpy as lln
    width = max([words] + [m.words for m, _ in jobs])
    flat = np.zeros((len(jobs) * positions, width), np.int32)
    heads = [(m.m, j * positions) for j, (m, d) in enumerate(jobs) if not d]
    along = [(m.m, j * positions, list(d)) for j, (m, d) in enumerate(jobs) if d]
    if heads:                           # llguidance takes no empty draft
        lln.fill_next_token_bitmask_par(executor(), heads, flat)
    if along:
        lln.fill_next_token_bitmask_par_with_draft_tokens(executor(), along, flat)
    out = flat.reshape(len(jobs), positions, width)
    for j, (m, d) in enumerate(jobs):
        m.fix_along(out[j, :len(d) + 1], d)
        out[j, len(d) + 1:] = out[j, len(d)]
    return np.ascontiguousarray(out[..., :words])


def _take(m, recent, k_recent, run, positions):
    """Feed one slot's parser its committed tokens and check `run`: (k taken, tokens consumed to
    roll back, the draft its masks are read along)."""
    m.advance_all(recent[:k_recent])
    k = m.validate(run)
    if positions == 1:                  # the mask after all it takes
        return k, m.advance_all(run[:k]), []
    return k, 0, m.draft_of(run[:min(k, positions - 1)])


def read_host(ticket, host, recent, recent_k, run, run_len, *, positions: int, words: int):
    """NumPy side of `host_read` (the callback): each asked slot's parser is fed and checked in
    turn, then all their masks are computed together (masks_along)."""
    b = ticket.shape[0]
    k_ok = np.zeros((b,), np.int32)
    bits = np.full((b, positions, words), -1, np.int32)
    rows, jobs, undo = [], [], []
    for i in np.flatnonzero(host):
        m = TICKETS.get(ticket[i])
        try:
            if m is None:
                raise KeyError(f"no parser for ticket {int(ticket[i])}")
            k_ok[i], taken, draft = _take(m, recent[i], int(recent_k[i]),
                                          run[i, :int(run_len[i])], positions)
            rows.append(i), jobs.append((m, draft)), undo.append(taken)
        except Exception as e:          # a parser fault stops its slot only: nothing allowed
            _fault(ticket[i], e)
            k_ok[i], bits[i] = 0, 0
    if jobs:
        try:
            bits[rows] = masks_along(jobs, positions, words)
        except Exception as e:
            for i in rows:
                _fault(ticket[i], e)
            k_ok[rows], bits[rows] = 0, 0
        for (m, _), n in zip(jobs, undo):
            m.rollback(n)
    return k_ok, bits


def _fault(ticket, e) -> None:
    log.error("constraint parser of ticket %d failed: %s", int(ticket), e)


def host_read(g, run, run_len, positions: int, live):
    """On the device: (k_ok [B], bits [B, positions, words]) from each live host slot's parser,
    after it consumed the slot's recent tokens: k_ok of `run` [B, R] (its first run_len [B])
    taken, and the allowed tokens after the first min(k_ok, p) of them at each position p
    (positions == 1: after all k_ok). A step with no live host slot does not call the host."""
    b = g.ticket.shape[0]
    words = (g.klass.shape[1] + 31) // 32
    if not g.parsers:               # device tables only: no host call in the program
        return jnp.zeros((b,), jnp.int32), jnp.full((b, positions, words), -1, jnp.int32)
    shapes = (jax.ShapeDtypeStruct((b,), jnp.int32),
              jax.ShapeDtypeStruct((b, positions, words), jnp.int32))
    asked = g.host & live

    def call(ticket, host, recent, recent_k, run, run_len):
        return read_host(np.asarray(ticket), np.asarray(host), np.asarray(recent),
                         np.asarray(recent_k), np.asarray(run), np.asarray(run_len),
                         positions=positions, words=words)

    def ask(_):
        return io_callback(call, shapes, g.ticket, asked, g.recent, g.recent_k, run, run_len,
                           ordered=True)

    def skip(_):
        return jnp.zeros((b,), jnp.int32), jnp.full((b, positions, words), -1, jnp.int32)
    return jax.lax.cond(jnp.any(asked), ask, skip, None)


def unpack_bits(bits, vocab: int):
    """[.., words] int32 -> [.., vocab] bool on the device."""
    v = jnp.arange(vocab, dtype=jnp.int32)
    words = jnp.take(bits, v // 32, axis=-1)
    return (jnp.right_shift(words, v % 32) & 1).astype(bool)
