"""The host backend: a constraint compiled by llguidance (JSON schema, regex, choice -> a grammar
its Earley parser matches token by token), for what the device tables cannot enforce exactly
(recursion, numeric bounds, `patternProperties`, large unions) or cannot build in time.

    Grammar        a compiled, validated constraint (jax-free; cached by the constraint's hash)
    Matcher        one request's parser: allowed tokens, advance, accepting, rollback
    llg_tokenizer  the tokenizer as llguidance reads it (built once per tokenizer)

Whitespace between JSON tokens is what the device tables allow (at most one space), so both
backends write the same JSON. Errors name the request's field and say what is wrong in the
schema's words (`minItems (5) is greater than maxItems (2)`), never the library's internals.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import numpy as np

from decode.config import DecodeConfigError
from decode.constraints.spec import JSON_OBJECT_SCHEMA, Constraint, escape

NAME = "host"
# llguidance's JSON options: the same separators and whitespace as the device tables
JSON_OPTIONS = {"whitespace_pattern": r"[ ]?", "coerce_one_of": False, "lenient": False}
_TOKENIZERS: dict = {}
_LOCK = threading.Lock()


def llg_tokenizer(tokenizer, vocab_size: int | None):
    """The llguidance tokenizer of a `wedlm_jax.tokenizer.Tokenizer` (or `tokenizers.Tokenizer`)
    over `vocab_size` ids (the model's, which may be larger than the tokenizer's; None: the
    tokenizer's)."""
    import llguidance
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    vocab_size = vocab_size or tok.get_vocab_size(with_added_tokens=True)
    key = (id(tokenizer), vocab_size)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
        if hit is None or hit[0] is not tokenizer:
            eos = getattr(tokenizer, "eos_token_id", None)
            hit = (tokenizer, llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size,
                                                     eos_token=eos if eos is not None else 0))
            _TOKENIZERS[key] = hit
    return hit[1]


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON form) of a constraint."""
    from llguidance import LLMatcher
    if constraint.kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.value)
    if constraint.kind == "grammar":
        return LLMatcher.grammar_from_lark(constraint.value)
    if constraint.kind == "choice":
        return LLMatcher.grammar_from_regex("(" + "|".join(escape(o) for o in constraint.value)
                                            + ")")
    schema = constraint.value if constraint.kind == "json_schema" else JSON_OBJECT_SCHEMA
    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
_FORMAT = re.compile(r"Unknown format: (\S+)")


def key_path(schema, key: str, path: str = "") -> str | None:
    """The dotted path of the first occurrence of `key` as a keyword in `schema`."""
    if isinstance(schema, dict):
        if key in schema:
            return f"{path}.{key}" if path else key
        for k, v in schema.items():
            found = key_path(v, key, f"{path}.{k}" if path else str(k))
            if found:
                return found
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            found = key_path(v, key, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def readable(message: str, constraint: Constraint) -> tuple[str, str]:
    """(field path, message) of an llguidance error, in the schema's words."""
    first = message.strip().splitlines()[0] if message.strip() else "cannot be compiled"
    field = constraint.field
    m = _UNIMPLEMENTED.search(message)
    if m and constraint.kind == "json_schema":
        path = key_path(json.loads(constraint.value), m.group(1))
        if path:
            return f"{field}.{path}", f"{field}.{path}: not supported"
    m = _FORMAT.search(message)
    if m and constraint.kind == "json_schema":
        path = key_path(json.loads(constraint.value), "format")
        where = f"{field}.{path}" if path else field
        return where, f"{where}: format {m.group(1)!r} is not supported"
    if "regex parse error" in message:
        detail = [ln.strip() for ln in message.splitlines() if ln.strip().startswith("error:")]
        first = detail[0][len("error:"):].strip() if detail else "invalid regular expression"
        first = first.replace("look-around, including look-ahead and look-behind,",
                              "lookaround (lookahead, lookbehind)")
    first = re.sub(r"^(Unsatisfiable schema|Error): ", "unsatisfiable: " if
                   first.startswith("Unsatisfiable") else "", first)
    return field, f"{field}: {first}"


@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
    """A constraint compiled for the host backend. `next_state` keeps the committed tokens (a
    readmission replays them into a fresh matcher)."""
    text: str
    key: str
    vocab_size: int
    tokenizer: object
    build_s: float = 0.0
    backend: str = NAME

    def next_state(self, state, token: int) -> tuple:
        return tuple(state or ()) + (int(token),)

    def matcher(self, stop_ids=(), tokens=()) -> "Matcher":
        return Matcher(self, stop_ids, tokens)


def compile_grammar(constraint: Constraint, tokenizer, vocab_size: int | None,
                    limits=None) -> Grammar:
    """The host Grammar of `constraint` (validated against the tokenizer): an unsupported keyword,
    an unsatisfiable schema or an invalid regex is a DecodeConfigError naming the field."""
    from llguidance import LLMatcher
    t0 = time.perf_counter()
    lltok = llg_tokenizer(tokenizer, vocab_size)
    try:
        text = grammar_text(constraint)
    except ValueError as e:
        raise DecodeConfigError(*reversed(readable(str(e), constraint))) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(text, lltok, limits=limits)
    if is_error:
        field, message = readable(messages[0] if messages else "", constraint)
        raise DecodeConfigError(message, field)
    return Grammar(text=text, key=constraint.key(), vocab_size=lltok.vocab_size, tokenizer=lltok,
                   build_s=time.perf_counter() - t0)


class Matcher:
    """One request's llguidance parser over its Grammar. Stop ids are allowed only where the
    grammar accepts; llguidance's own end token only when it is one of them."""

    def __init__(self, grammar: Grammar, stop_ids=(), tokens=()):
        import llguidance
        self.grammar = grammar
        self.m = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        self.stop_ids = np.asarray(sorted({int(i) for i in stop_ids
                                           if 0 <= int(i) < grammar.vocab_size}), np.int64)
        self.words = (grammar.vocab_size + 31) // 32
        self.eos = set(grammar.tokenizer.eos_tokens)
        if tokens:
            self.advance_all(tokens)

    def _fix(self, bits: np.ndarray) -> np.ndarray:
        """bits [words] int32 with the stop ids set where accepting and llguidance's own end
        tokens only among them."""
        u = bits.view(np.uint32)
        stops = set(self.stop_ids.tolist())
        for e in self.eos:
            if e not in stops and e < self.grammar.vocab_size:
                u[e // 32] &= ~np.uint32(1 << (e % 32))
        if self.m.is_accepting() and len(self.stop_ids):
            np.bitwise_or.at(u, self.stop_ids // 32,
                             (np.uint32(1) << (self.stop_ids % 32).astype(np.uint32)))
        return bits

    def bits(self) -> np.ndarray:
        """[words] int32: the tokens allowed next, one bit each."""
        raw = np.frombuffer(self.m.compute_bitmask(), np.int32)[:self.words].copy()
        return self._fix(raw)

    def draft_of(self, tokens) -> list[int]:
        """`tokens` up to (not with) the first stop or end token: what llguidance reads ahead."""
        toks = [int(t) for t in tokens]
        return toks[:next((i for i, t in enumerate(toks) if self.is_stop(t) or t in self.eos),
                          len(toks))]

    def fix_along(self, rows: np.ndarray, draft) -> np.ndarray:
        """rows [len(draft) + 1, words]: llguidance's masks after each prefix of `draft` (which
        the grammar takes), with the stop ids set where that prefix is accepting."""
        for p in range(len(draft) + 1):
            if p:
                self.m.consume_token(int(draft[p - 1]))
            self._fix(rows[p])
        self.rollback(len(draft))
        return rows

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens allowed next."""
        return unpack(self.bits(), self.grammar.vocab_size)

    def is_stop(self, token: int) -> bool:
        return bool(np.any(self.stop_ids == int(token)))

    def validate(self, tokens) -> int:
        """How many of `tokens` the grammar takes from here, a stop id included where the
        grammar accepts (nothing is consumed). llguidance's end token, when not a stop id, is
        never taken."""
        toks = [int(t) for t in tokens]
        cut = next((i for i, t in enumerate(toks) if self.is_stop(t) or t in self.eos),
                   len(toks))
        k = int(self.m.validate_tokens(toks[:cut])) if cut else 0
        if k < cut or cut == len(toks) or not self.is_stop(toks[cut]):
            return k
        self.m.consume_tokens(toks[:k])
        ok = self.m.is_accepting()
        self.m.rollback(k)
        return k + 1 if ok else k

    def advance(self, token: int) -> bool:
        """Consume one token (False: not allowed; the matcher is then unchanged)."""
        if self.is_stop(token):
            return self.m.is_accepting()
        if int(token) in self.eos or self.m.validate_tokens([int(token)]) != 1:
            return False
        return bool(self.m.consume_token(int(token)))

    def advance_all(self, tokens) -> int:
        """Consume `tokens` up to the first not allowed (or a stop); returns how many."""
        for i, t in enumerate(tokens):
            if self.is_stop(t) or not self.advance(t):
                return i
        return len(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(int(n))

    def accepting(self) -> bool:
        return bool(self.m.is_accepting())


def unpack(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """[.., words] int32 bitmask -> [.., vocab_size] bool."""
    b = np.asarray(bits).view(np.uint32)
    v = np.arange(vocab_size)
    return ((b[..., v // 32] >> (v % 32).astype(np.uint32)) & 1).astype(bool)
