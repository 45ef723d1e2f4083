"""Which `pattern`s outlines-core's regex enforces with the meaning JSON schema gives them: a
subset of the regex syntax whose Rust (outlines-core) and Python (`re`, `jsonschema`) readings
agree, over characters a JSON string holds as themselves."""

from __future__ import annotations

import re

_PUNCT = set(".-+*?()[]{}|^$/")
_QUANT = re.compile(r"[*+?]\??|\{\d+(,\d*)?\}\??")


def plain_char(ch: str) -> bool:
    """A character that a JSON string holds as itself (no escape needed)."""
    return ch not in '"\\' and ord(ch) >= 0x20 and not 0x7F <= ord(ch) <= 0x9F


def _class_end(p: str, i: int) -> int | None:
    """The index after the class at p[i] == "[", or None when outside the safe subset (no
    negation, no nested class or set operation, no character needing a JSON escape)."""
    i += 1
    if i < len(p) and p[i] == "^":
        return None
    prev = None
    while i < len(p) and p[i] != "]":
        ch = p[i]
        if ch == "\\":
            esc = p[i + 1:i + 2]
            if esc != "d" and esc not in _PUNCT:
                return None
            prev, i = (None if esc == "d" else esc), i + 2
        elif ch == "-" and prev is not None and i + 1 < len(p) and p[i + 1] != "]":
            hi = p[i + 1]
            if hi in "\\[" or not all(plain_char(chr(c)) for c in range(ord(prev), ord(hi) + 1)):
                return None
            prev, i = None, i + 2
        elif ch == "[" or not plain_char(ch) or p[i:i + 2] in ("&&", "--", "~~"):
            return None
        else:
            prev, i = ch, i + 1
    return i + 1 if i < len(p) and i > 0 else None


def _sequence_end(p: str, i: int, top: bool) -> int | None:
    """The index where the sequence from p[i] ends (")" or the end), None when unsafe."""
    while i < len(p):
        ch = p[i]
        if ch == ")" and not top:
            return i
        if ch == "|" and not top:
            i += 1
            continue
        if ch == "(":
            start = i + 3 if p.startswith("(?:", i) else i + 1
            if p[start:start + 1] == "?":
                return None
            end = _sequence_end(p, start, False)
            if end is None or end >= len(p):
                return None
            i = end + 1
        elif ch == "[":
            i = _class_end(p, i)
            if i is None:
                return None
        elif ch == "\\":
            esc = p[i + 1:i + 2]
            if esc != "d" and esc not in _PUNCT:
                return None
            i += 2
        elif ch in "|)^$*+?{}]." or not plain_char(ch):
            return None
        else:
            i += 1
        m = _QUANT.match(p, i)
        if m:
            i = m.end()
    return i


def safe_pattern(pattern: str) -> bool:
    """Whether outlines-core's `"` + pattern + `"` (anchors ^...$ stripped) only produces JSON
    strings whose text matches `pattern` in full, with the same meaning in Python's `re`:
    literals, escaped punctuation, `\\d`, classes of such, groups, alternation inside a group,
    quantifiers. `.`, `\\w`, `\\s`, negated classes, look-around and top-level `|` are not."""
    if pattern.startswith("^") and pattern.endswith("$") and len(pattern) >= 2:
        pattern = pattern[1:-1]
    if pattern.endswith("\\") or _QUANT.match(pattern):
        return False
    return _sequence_end(pattern, 0, True) == len(pattern)
