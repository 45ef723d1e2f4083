"""Text around the engine: the checkpoint folder's tokenizer and chat template (the shared
`wedlm_jax.tokenizer`, the same one training uses), and stop handling.

Stops: ids from `generation_config.json` (`eos_token_id`), the model config's eos, the tokenizer
config's `eos_token`, and `<|im_end|>` / `<|endoftext|>` when the vocabulary has them
(`Tokenizer.default_stop_ids`), plus any ids or strings the user gives. A stop string that is a
single token becomes a stop id (the loop ends the row there); a longer one cannot be matched inside
the loop, so the row runs on and its ids and text are cut after the first occurrence (inclusive)
once decoding is done. A stop string that tokenizes to nothing is an error.
"""

from __future__ import annotations

from typing import Sequence

from decode.config import DecodeConfigError
from wedlm_jax import tokenizer as tokenizer_lib
from wedlm_jax.tokenizer import DEFAULT_STOP_TOKENS, ChatTemplateError  # noqa: F401 (re-exported)

TextTokenizer = tokenizer_lib.Tokenizer


def load_tokenizer(folder) -> TextTokenizer:
    return tokenizer_lib.load_tokenizer(
        folder, error=DecodeConfigError,
        hint=" (text prompts need the checkpoint's Hugging Face tokenizer)")


def split_stop_strings(tokenizer: TextTokenizer, strings: Sequence[str]) -> tuple[list[int], list[str]]:
    """(ids of single-token stop strings, the multi-token strings cut after decoding)."""
    ids, cut = [], []
    for s in strings:
        enc = tokenizer.encode(s)
        if not enc:
            raise DecodeConfigError(f"stop string {s!r} tokenizes to nothing")
        if len(enc) == 1:
            ids.append(enc[0])
        else:
            cut.append(s)
    return ids, cut


def cut_at_stop_strings(tokenizer: TextTokenizer, ids: list[int], strings: Sequence[str]) -> tuple[list[int], bool]:
    """Shortest prefix of `ids` whose text contains one of `strings` (inclusive); else all ids."""
    if not strings or not any(s in tokenizer.decode(ids) for s in strings):
        return ids, False
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        if any(s in text for s in strings):
            return ids[:k], True
    return ids, False
