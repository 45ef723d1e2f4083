"""Text around the engine: the checkpoint folder's Hugging Face tokenizer (`tokenizer.json`), its
chat template (`tokenizer_config.json` or `chat_template.jinja`), and stop handling.

Stops: ids from `generation_config.json` (`eos_token_id`), the model config's eos, the tokenizer
config's `eos_token`, and `<|im_end|>` / `<|endoftext|>` when the vocabulary has them, plus any ids
or strings the user gives. A stop string that is a single token becomes a stop id (the loop ends
the row there); a longer one cannot be matched inside the loop, so the row runs on and its ids and
text are cut after the first occurrence (inclusive) once decoding is done. A stop string that
tokenizes to nothing is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from decode.config import DecodeConfigError

DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _read_json(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise DecodeConfigError(f"{path}: not valid JSON ({e})") from None


def _token_string(tok):
    """tokenizer_config special tokens are either strings or {'content': ...} dicts."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


@dataclasses.dataclass
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what tokenizer_config.json / generation_config.json say."""
    tokenizer: object
    chat_template: str | None
    special: dict          # bos_token / eos_token / ... strings
    generation_eos: tuple  # ids from generation_config.json

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise DecodeConfigError("--chat needs a chat template: the checkpoint's "
                                    "tokenizer_config.json has no 'chat_template' and there is no "
                                    "chat_template.jinja")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def default_stop_ids(self, model_eos=None) -> list[int]:
        ids = list(self.generation_eos)
        if model_eos is not None:
            ids += list(model_eos) if isinstance(model_eos, (tuple, list)) else [model_eos]
        for tok in (self.special.get("eos_token"),) + DEFAULT_STOP_TOKENS:
            i = self.token_id(tok)
            if i is not None:
                ids.append(i)
        return list(dict.fromkeys(int(i) for i in ids))


def load_tokenizer(folder) -> TextTokenizer:
    from tokenizers import Tokenizer
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise DecodeConfigError(f"{folder}: no tokenizer.json (text prompts need the checkpoint's "
                                "Hugging Face tokenizer)")
    tok = Tokenizer.from_file(path)
    cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
        with open(jinja_file) as f:
            template = f.read()
    special = {k: _token_string(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    special = {k: v for k, v in special.items() if v is not None}
    gen = _read_json(os.path.join(folder, "generation_config.json"))
    eos = gen.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return TextTokenizer(tok, template, special, tuple(int(e) for e in eos))


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
