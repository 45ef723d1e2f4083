"""Text around the engine: the checkpoint folder's tokenizer and chat template (the shared
`wedlm_jax.tokenizer`, the same one training uses), and stop handling.

Stops: ids from `generation_config.json` (`eos_token_id`), the model config's eos, the tokenizer
config's `eos_token`, and `<|im_end|>` / `<|endoftext|>` when the vocabulary has them
(`Tokenizer.default_stop_ids`), plus any ids or strings the user gives. A stop string that is a
single token becomes a stop id (the loop ends the row there); a longer one cannot be matched inside
the loop: `TextStream` (the one handler every door uses) watches the committed text, cuts it before
the first occurrence (the ids are kept through the token that completed it) and the door cancels
the row. A stop string that tokenizes to nothing is an error.
"""

from __future__ import annotations

import dataclasses
import json

from typing import Sequence

from decode.config import DecodeConfigError
from wedlm_jax import tokenizer as tokenizer_lib
from wedlm_jax.tokenizer import DEFAULT_STOP_TOKENS, ChatTemplateError  # noqa: F401 (re-exported)

TextTokenizer = tokenizer_lib.Tokenizer


def load_tokenizer(folder, chat_template: str | None = None) -> TextTokenizer:
    """The checkpoint's tokenizer; with `chat_template` (a file: --chat-template), that template
    in place of the folder's own."""
    tokenizer = tokenizer_lib.load_tokenizer(
        folder, error=DecodeConfigError,
        hint=" (text prompts need the checkpoint's Hugging Face tokenizer)")
    return tokenizer if chat_template is None else with_chat_template(tokenizer, chat_template)


def read_chat_template(path: str, special: dict | None = None) -> str:
    """The chat template in the file at `path` (--chat-template), checked before any model
    loads: it must read and render a one-message conversation."""
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DecodeConfigError(f"--chat-template {path}: cannot read it "
                                f"({getattr(e, 'strerror', None) or e})", "chat_template") from None
    try:
        tokenizer_lib.render_chat(template, [{"role": "user", "content": "hi"}],
                                  add_generation_prompt=True, special=special, source=path)
    except ChatTemplateError as e:
        raise DecodeConfigError(f"--chat-template {e}", "chat_template") from None
    return template


def with_chat_template(tokenizer: TextTokenizer, path: str) -> TextTokenizer:
    """`tokenizer` with the chat template of the file at `path` in place of its folder's."""
    template = read_chat_template(path, tokenizer.special)
    return dataclasses.replace(tokenizer, chat_template=template, template_source=path)


def split_stop_strings(tokenizer: TextTokenizer, strings: Sequence[str]) -> tuple[list[int], list[str]]:
    """(ids of single-token stop strings, the multi-token strings cut after decoding)."""
    ids, cut = [], []
    for s in strings:
        try:
            enc = tokenizer.encode(s)
        except ValueError as e:      # wedlm_jax.tokenizer.TextError
            raise DecodeConfigError(f"stop string {ascii(s)}: {e}") from None
        if not enc:
            raise DecodeConfigError(f"stop string {s!r} tokenizes to nothing")
        if len(enc) == 1:
            ids.append(enc[0])
        else:
            cut.append(s)
    return ids, cut


def first_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest occurrence of any stop string in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


class TextStream:
    """The one stop-string and finish handler of every door (wedlm-decode, the batch job,
    wedlm-serve): token ids in as they are committed, text deltas out. Holds back an incomplete
    UTF-8 tail and any tail that may be the start of a stop string; at the first stop string the
    text is cut before it (OpenAI's convention) and `stopped` is set; `n_used` counts the
    completion tokens through the one that completed the stop string."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tok, self.stops = tokenizer, list(stops)
        self.ids: list = []
        self.sent = ""
        self.stopped = False
        self.n_used = 0

    def add(self, new) -> str:
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in new)
        self.n_used = len(self.ids)
        text = self.tok.decode(self.ids)
        cut = first_stop(text, self.stops) if self.stops else -1
        if cut >= 0:
            self.stopped = True
            self.n_used = self._tokens_through_stop()
            return self._emit(text[:cut])
        safe = text.rstrip("\ufffd")
        hold = max((k for s in self.stops for k in range(1, len(s)) if safe.endswith(s[:k])), default=0)
        return self._emit(safe[:len(safe) - hold])

    def finish(self) -> str:
        """The rest of the text once no token will come (nothing after a stop string)."""
        return "" if self.stopped else self._emit(self.tok.decode(self.ids))

    def finish_reason(self, engine_reason: str) -> str:
        """'stop' when a stop string ended the text, else the engine's own reason."""
        return "stop" if self.stopped else engine_reason

    def _emit(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def _tokens_through_stop(self) -> int:
        for k in range(1, len(self.ids) + 1):
            if first_stop(self.tok.decode(self.ids[:k]), self.stops) >= 0:
                return k
        return len(self.ids)


def stop_at_strings(tokenizer: TextTokenizer, ids: list[int], strings: Sequence[str]
                    ) -> tuple[list[int], str, bool]:
    """A finished completion through `TextStream`: (ids through the first stop string, the text
    before it, whether one was found); all ids and their whole text when none is."""
    stream = TextStream(tokenizer, strings)
    stream.add(ids)
    stream.finish()
    return list(ids[:stream.n_used]), stream.sent, stream.stopped


def json_lines(path: str, keep_bad: bool = False):
    """(line number, object) of every non-blank line of a JSONL file (1-based);
    a line that is not UTF-8 or not JSON raises DecodeConfigError naming it (with `keep_bad`: that
    error is the line's object, and reading goes on). A bad byte costs exactly its own line: the
    file is read as bytes and each line decoded on its own."""
    with open(path, "rb") as f:
        yield from json_line_objects(f, path, keep_bad)


def json_line_objects(lines, name: str, keep_bad: bool = False):
    """`json_lines` of an iterable of byte lines (an open file, a BytesIO), named `name`."""
    for lineno, raw in enumerate(lines, 1):
        where = f"{name}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = DecodeConfigError(f"{where}: not UTF-8 ({e.reason} at byte {e.start + 1} of "
                                    "the line)")
            if not keep_bad:
                raise bad from None
            yield lineno, bad
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if not keep_bad:
                raise DecodeConfigError(f"{where}: not valid JSON ({e})") from None
            obj = DecodeConfigError(f"{where}: not valid JSON ({e})")
        yield lineno, obj
