"""A tokenizer's vocabulary as bytes: what each token id appends to the text, for the token
automaton (outlines-core's `Vocabulary` takes tokens as bytes)."""

from __future__ import annotations

import functools
import re


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes), inverted."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(token: str, byte_level: bool) -> bytes | None:
    """The bytes one vocabulary entry decodes to (None: not representable)."""
    if byte_level:
        dec = _byte_decoder()
        if not all(ch in dec for ch in token):
            return None
        return bytes(dec[ch] for ch in token)
    m = _HEX_BYTE.match(token)
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def vocabulary_bytes(tokenizer) -> tuple[dict, int]:
    """({token bytes: [ids]} of every ordinary token, vocabulary size) of a
    `wedlm_jax.tokenizer.Tokenizer` (or a `tokenizers.Tokenizer`). Added / special tokens are
    left out: a constraint never allows them (stop tokens are the automaton's accepting states)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    import json
    desc = json.loads(tok.to_str())
    dec = desc.get("decoder") or {}
    kinds = {d.get("type") for d in dec.get("decoders", [dec])}
    byte_level = "ByteLevel" in kinds
    special = {a["content"] for a in desc.get("added_tokens", [])}
    out: dict = {}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if token in special:
            continue
        b = token_bytes(token, byte_level)
        if b:
            out.setdefault(b, []).append(int(i))
    return out, tok.get_vocab_size(with_added_tokens=True)
