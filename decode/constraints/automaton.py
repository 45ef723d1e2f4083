"""A constraint compiled into the tables the decoder reads on the device.

outlines-core builds the token-level automaton (`Index`: regex -> DFA over the vocabulary's
tokens, each token one transition); this module lays it out compactly:

  klass  [V] int32     token -> class; tokens with the same transition from every state share
                       one. Class 0: tokens never allowed (special tokens, tokens outside the
                       language); class 1: the request's stop tokens (`STOP`)
  trans  [N, C] int32  next state of (state, class), -1: not allowed. State 0 is the initial
                       state; the stop class leads from an accepting state to itself
  accept [N] bool      the accepting states (a stop token is allowed there only)

A token t is allowed in state s iff trans[s, klass[t]] >= 0: no per-token bitmask is needed, and
the tables hold N x C + V entries (C is a few hundred for a JSON schema even on a 152K
vocabulary). Built once per (constraint, vocabulary) and kept in a small host cache
(`compile_constraint`); a table above `MAX_TABLE_BYTES` is refused naming the request's field.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np

from decode.config import DecodeConfigError
from decode.constraints.spec import Constraint

NAME = "device"
NEVER, STOP = 0, 1
MAX_TABLE_BYTES = 64 << 20        # trans + klass of one constraint
CACHE_SIZE = 64


@dataclasses.dataclass(frozen=True, eq=False)
class Automaton:
    """A compiled constraint (host NumPy tables; module docstring)."""
    klass: np.ndarray
    trans: np.ndarray
    accept: np.ndarray
    key: str
    build_s: float = 0.0

    backend = NAME

    @property
    def vocab_size(self) -> int:
        return len(self.klass)

    def matcher(self, stop_ids=(), state: int = 0):
        return DeviceMatcher(self, stop_ids, state)

    @property
    def num_states(self) -> int:
        return self.trans.shape[0]

    @property
    def num_classes(self) -> int:
        return self.trans.shape[1]

    @property
    def nbytes(self) -> int:
        return self.klass.nbytes + self.trans.nbytes + self.accept.nbytes

    def next_state(self, state: int, token: int) -> int:
        """The state after `token` (-1: not allowed); stop tokens are the request's."""
        return int(self.trans[state, self.klass[token]]) if state >= 0 else -1

    def allowed(self, state: int) -> np.ndarray:
        """[V] bool: the tokens allowed in `state` (stop tokens as class STOP)."""
        return self.trans[state][self.klass] >= 0

    def with_stops(self, stop_ids) -> np.ndarray:
        """The class table with the request's stop tokens in class STOP."""
        k = self.klass.copy()
        ids = [int(i) for i in stop_ids if 0 <= int(i) < len(k)]
        k[ids] = STOP
        return k


class DeviceMatcher:
    """The token-by-token walk of an Automaton's tables (what the device reads)."""

    def __init__(self, auto, stop_ids=(), state: int = 0):
        self.auto, self.state = auto, int(state)
        self.klass = auto.with_stops(stop_ids)
        self.stops = {int(i) for i in stop_ids}

    def allowed(self) -> np.ndarray:
        return self.auto.trans[self.state][self.klass] >= 0

    def advance(self, token: int) -> bool:
        if int(token) in self.stops:
            return bool(self.auto.accept[self.state])
        nxt = int(self.auto.trans[self.state, self.klass[int(token)]])
        if nxt < 0:
            return False
        self.state = nxt
        return True

    def accepting(self) -> bool:
        return bool(self.auto.accept[self.state])


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64, wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# outlines-core (0.2.14) leaves out a token's transition from an accepting state into a state
# that is not accepting (`a|a b` has no " " after "a"). So the Index is built for R + END, END a
# character with a token of its own (a noncharacter): a state after R + END is final, so the
# transitions of R are all there. R's accepting states are those whose END transition reaches
# a final state (END may also be content of R, inside a JSON string say: that transition stays
# in R); the END transitions are then removed.
END_CHAR = "\uffff"
END_REGEX = r"\x{FFFF}"


def build_index(regex: str, vocab: dict, vocab_size: int):
    """An outlines-core Index of `regex` followed by END over `vocab`; END is token
    `vocab_size`, eos `vocab_size + 1`."""
    from outlines_core import Index, Vocabulary
    end = END_CHAR.encode()
    tokens = {b: ids for b, ids in vocab.items() if b != end}
    tokens[end] = [vocab_size]
    return Index(f"({regex}){END_REGEX}", Vocabulary(vocab_size + 1, tokens))


def _flat(index):
    """(state of each transition, token, next state, final [N] bool) with states renumbered
    0.. (the initial state first)."""
    raw = index.get_transitions()
    init = index.get_initial_state()
    names = [init] + sorted(({s for s in raw} | {n for d in raw.values() for n in d.values()}
                             | set(index.get_final_states())) - {init})
    num = {s: i for i, s in enumerate(names)}
    src, tok, dst = [], [], []
    for s, d in raw.items():
        src.append(np.full(len(d), num[s], np.int64))
        tok.append(np.fromiter(d.keys(), np.int64, len(d)))
        dst.append(np.fromiter((num[v] for v in d.values()), np.int64, len(d)))
    final = np.zeros(len(names), bool)
    final[[num[f] for f in index.get_final_states()]] = True
    return np.concatenate(src), np.concatenate(tok), np.concatenate(dst), final


def _prune(src, tok, dst, final, vocab_size):
    """The transitions of R alone (END's removed), the accepting states, and the states kept
    (reachable from the initial state, each with a way on or accepting), renumbered."""
    n = len(final)
    is_end = tok == vocab_size
    accept = np.zeros(n, bool)
    accept[src[is_end & final[dst]]] = True
    keep = (~is_end) & (tok < vocab_size)
    src, tok, dst = src[keep], tok[keep], dst[keep]
    live = accept.copy()                   # states from which an accepting state is reached
    while True:
        more = live.copy()
        more[src[live[dst]]] = True
        if (more == live).all():
            break
        live = more
    keep = live[src] & live[dst]
    src, tok, dst = src[keep], tok[keep], dst[keep]
    seen = np.zeros(n, bool)
    seen[0] = True
    while True:
        more = seen.copy()
        more[dst[seen[src]]] = True
        if (more == seen).all():
            break
        seen = more
    keep = seen[src]
    new = np.cumsum(seen) - 1
    return new[src[keep]], tok[keep], new[dst[keep]], accept[seen]


def tables(index, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(klass, trans, accept) of an Index from `build_index` (module docstring). Tokens are
    grouped by a hash of their transitions, then every transition is checked against the
    tables."""
    src, tok, dst, accept = _prune(*_flat(index), vocab_size)
    n = len(accept)
    h = _mix(_mix(src.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) ^ dst.astype(np.uint64))
    order = np.argsort(tok, kind="stable")
    tok_s, h_s = tok[order], h[order]
    sig = np.zeros(vocab_size, np.uint64)
    if len(tok_s):
        starts = np.flatnonzero(np.r_[True, tok_s[1:] != tok_s[:-1]])
        sig[tok_s[starts]] = np.add.reduceat(h_s, starts)
    used = sig != 0
    uniq, klass = np.unique(sig[used], return_inverse=True)
    full = np.full(vocab_size, NEVER, np.int32)
    full[used] = klass + 2
    trans = np.full((n, len(uniq) + 2), -1, np.int32)
    trans[src, full[tok]] = dst
    trans[:, STOP] = np.where(accept, np.arange(n), -1)
    counts = np.bincount(tok, minlength=vocab_size)
    if (np.any(trans[src, full[tok]] != dst)
            or np.any((trans[:, full] >= 0).sum(0)[used] != counts[used])):
        raise RuntimeError("token classes collided; the automaton's tables are inconsistent")
    return full, trans, accept


class _Cache:
    def __init__(self, size: int):
        self.size, self.items, self.lock = size, collections.OrderedDict(), threading.Lock()

    def get(self, key):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        return None

    def put(self, key, value):
        with self.lock:
            self.items[key] = value
            while len(self.items) > self.size:
                self.items.popitem(last=False)


_CACHE = _Cache(CACHE_SIZE)


def vocabulary_key(vocab: dict, vocab_size: int) -> str:
    import hashlib
    h = hashlib.sha256(str(vocab_size).encode())
    for b in sorted(vocab):
        h.update(b + b"\0" + ",".join(map(str, vocab[b])).encode() + b"\1")
    return h.hexdigest()


def compile_constraint(constraint: Constraint, vocab: dict, vocab_size: int,
                       vocab_key: str | None = None,
                       max_bytes: int = MAX_TABLE_BYTES) -> Automaton:
    """The Automaton of `constraint` over `vocab` ({token bytes: [ids]}, `vocabulary_bytes`),
    from the cache when built before. Errors (an invalid regex, a language the vocabulary cannot
    write, tables above `max_bytes`) are DecodeConfigErrors naming the constraint's field."""
    vkey = vocab_key or vocabulary_key(vocab, vocab_size)
    key = f"{constraint.key()}:{vkey}"
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    field = constraint.field
    t0 = time.perf_counter()
    regex = constraint.to_regex()
    try:
        index = build_index(regex, vocab, vocab_size)
    except (ValueError, TypeError) as e:
        raise DecodeConfigError(f"{field}: cannot compile the constraint ({e})", field) from None
    est = len(index.get_transitions()) * 4 * 64 + 4 * vocab_size
    if est > 64 * max_bytes:
        raise DecodeConfigError(f"{field}: the constraint's automaton is too large", field)
    klass, trans, accept = tables(index, vocab_size)
    auto = Automaton(klass=klass, trans=trans, accept=accept, key=key,
                     build_s=time.perf_counter() - t0)
    if auto.nbytes > max_bytes:
        raise DecodeConfigError(f"{field}: the constraint's tables take {auto.nbytes} bytes "
                                f"({auto.num_states} states x {auto.num_classes} token classes), "
                                f"above the limit of {max_bytes}", field)
    _CACHE.put(key, auto)
    return auto


_VOCABS: dict = {}


def for_tokenizer(constraint: Constraint, tokenizer) -> Automaton:
    """`compile_constraint` over a tokenizer's vocabulary (read once per tokenizer)."""
    from decode.constraints.vocab import vocabulary_bytes
    key = id(tokenizer)
    if key not in _VOCABS:
        vocab, size = vocabulary_bytes(tokenizer)
        _VOCABS[key] = (tokenizer, vocab, size, vocabulary_key(vocab, size))
    _, vocab, size, vkey = _VOCABS[key]
    return compile_constraint(constraint, vocab, size, vkey)
