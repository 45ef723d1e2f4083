"""The one tokenizer of training and decoding: a checkpoint folder's Hugging Face `tokenizer.json`,
its special tokens and its chat template.

    tok = load_tokenizer(folder)
    ids = tok.encode(text)                                         # no special tokens added
    text = tok.render_chat(messages, add_generation_prompt=True, tools=None)
    stops = tok.default_stop_ids(model_eos)

Read from the folder: `tokenizer.json` (the `tokenizers` library), the named special tokens
(`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`) from
`tokenizer_config.json`, else `special_tokens_map.json`, the chat template from
`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of named
templates of which `default` is used; the file wins, as in transformers 5), and the eos ids of
`generation_config.json`.

Chat templates render the way transformers' `apply_chat_template` renders them: a sandboxed,
immutable Jinja environment with `trim_blocks` and `lstrip_blocks`, the loop controls
`{% break %}` / `{% continue %}`, a `tojson` filter that does not escape HTML or non-ASCII
(`ensure_ascii`, `indent`, `separators`, `sort_keys` as in `json.dumps`), the globals
`raise_exception(msg)` and `strftime_now(fmt)`, and a `namespace` that refuses underscore names.
The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the named special
tokens the folder defines, and any extra keyword; a message's reasoning given as
`reasoning_content`, `thinking` or `reasoning` is visible under the first two names. The rendered
text is encoded without added special tokens.

A template that does not parse, or fails on a conversation, raises `ChatTemplateError` with the
template's own message and the index (and role) of the first message whose conversation prefix
fails to render.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from datetime import datetime
from typing import Any, Sequence

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")
# Chat turns of the Qwen family (and the released WeDLM checkpoints) end with <|im_end|>; documents
# with <|endoftext|>. The official WeDLM example stops on eos and both.
DEFAULT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
MASK_TOKEN_CANDIDATES = ("<|mask|>", "[MASK]", "<mask>", "<|MASK|>", "<MASK>")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer folder (or file in it) that cannot be used."""


class ChatTemplateError(TokenizerError):
    """A chat template that does not parse, or fails to render a conversation."""


# --------------------------------------------------------------------------- the Jinja environment

def _raise_exception(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _checked_name(name):
    import jinja2
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template may not store the underscore name {name!r} on a namespace")
    return name


def _namespace_class():
    import jinja2.utils

    class SafeNamespace(jinja2.utils.Namespace):
        """jinja2's `namespace()`, refusing underscore-prefixed attributes."""

        def __init__(*args, **kwargs):  # noqa: N805 (same signature trick as jinja2's Namespace)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _checked_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            jinja2.utils.Namespace.__setitem__(self, _checked_name(name), value)

    return SafeNamespace


def _plain_dict(*args, **kwargs):
    return dict(*args, **kwargs)


def chat_environment():
    """A fresh Jinja environment that renders chat templates as transformers does."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_namespace_class(), dict=_plain_dict)
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return chat_environment().from_string(template)


def compile_template(template: str, source: str = "the chat template"):
    """The compiled template, or ChatTemplateError naming `source` and the template line."""
    import jinja2
    try:
        return _compiled(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{source} does not parse: {e.message} "
                                f"(template line {e.lineno})") from None


def _with_reasoning_aliases(messages):
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if isinstance(m.get("tool_calls"), list):
            m = {**m, "tool_calls": [_call_object(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


def _call_object(call):
    """A tool call with its arguments as an object: OpenAI's wire form carries them as JSON
    text, chat templates write them with `tojson` (the text would be quoted twice)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"] or "{}")
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def _describe(e: Exception) -> str:
    import jinja2
    if isinstance(e, jinja2.exceptions.TemplateError) and type(e) is jinja2.exceptions.TemplateError:
        return str(e)  # raise_exception(...): the template's own words
    return f"{type(e).__name__}: {e}"


def render_chat(template: str, messages: Sequence[dict], *, add_generation_prompt: bool,
                tools=None, documents=None, special: dict | None = None,
                source: str = "the chat template", **kwargs) -> str:
    """`messages` rendered by `template` (see the module docstring for what it sees)."""
    compiled = compile_template(template, source)
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of objects, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"message {i} must be an object, got {type(m).__name__}")
    messages = _with_reasoning_aliases(messages)
    context = {**(special or {}), **kwargs}

    def render(msgs):
        return compiled.render(messages=msgs, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **context)
    try:
        return render(messages)
    except Exception as e:  # a template is a program: any error it raises is reported as its own
        error = e
    for k in range(1, len(messages) + 1):
        try:
            render(messages[:k])
        except Exception:
            role = messages[k - 1].get("role")
            raise ChatTemplateError(f"{source} fails to render from message {k - 1} (role "
                                    f"{role!r}) on: {_describe(error)}") from None
    raise ChatTemplateError(f"{source} fails to render the {len(messages)} messages together "
                            f"(every shorter prefix renders): {_describe(error)}") from None


# --------------------------------------------------------------------------- the folder's tokenizer

def _read_json(path: str, error=TokenizerError) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise error(f"{path}: not valid JSON ({e})") from None


def _token_string(tok):
    """Special tokens are written either as strings or as {'content': ...} objects."""
    return tok.get("content") if isinstance(tok, dict) else tok


class TextError(ValueError):
    """Text a tokenizer cannot take: not a string, or not valid Unicode (a lone surrogate, as a
    JSON escape like \\ud800 or a non-UTF-8 byte in argv decodes to)."""


def check_text(text, what: str = "text") -> str:
    """`text` itself when it is a string of valid Unicode; TextError naming the first bad
    character otherwise."""
    if not isinstance(text, str):
        raise TextError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TextError(f"{what} is not valid Unicode: {ascii(text[e.start])} at character "
                        f"{e.start + 1} is a lone surrogate (an invalid escape or byte)") from None
    return text


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the folder's json files say around it."""
    tokenizer: Any             # tokenizers.Tokenizer
    folder: str
    chat_template: str | None
    template_source: str       # the file the template came from (for error messages)
    special: dict              # named special token strings (bos_token, eos_token, ...)
    generation_eos: tuple      # eos ids of generation_config.json

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(check_text(text), add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        if not self.chat_template:
            raise ChatTemplateError(f"{self.folder}: no chat template (tokenizer_config.json has no "
                                    f"'chat_template' and there is no chat_template.jinja)")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           tools=tools, special=self.special,
                           source=f"the chat template of {self.template_source}", **kwargs)

    apply_chat_template = render_chat

    def encode_chat(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, **kwargs))

    def default_stop_ids(self, model_eos=None) -> list[int]:
        """generation_config.json's eos ids, the model config's eos, the tokenizer's eos token, and
        <|im_end|> / <|endoftext|> where the vocabulary holds them; in that order, no repeats."""
        ids = list(self.generation_eos)
        if model_eos is not None:
            ids += list(model_eos) if isinstance(model_eos, (tuple, list)) else [model_eos]
        for tok in (self.eos_token,) + DEFAULT_STOP_TOKENS:
            i = self.token_id(tok)
            if i is not None:
                ids.append(i)
        return list(dict.fromkeys(int(i) for i in ids))


def _chat_template(folder: str, cfg: dict, error) -> tuple[str | None, str]:
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    template = cfg.get("chat_template")
    source = os.path.join(folder, "tokenizer_config.json")
    if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise error(f"{source}: 'chat_template' must be a string or a list of named templates")
    return template, source


def find_mask_token(tok: "Tokenizer") -> int | None:
    """The id of the tokenizer's mask token (the first of MASK_TOKEN_CANDIDATES it has), or None."""
    for cand in MASK_TOKEN_CANDIDATES:
        i = tok.tokenizer.token_to_id(cand)
        if i is not None:
            return int(i)
    return None


def mask_token_rule(config, tok: "Tokenizer | None", source: str = "config.json",
                    how: str = "wedlm-decode --mask-token-id ID") -> tuple[int | None, str]:
    """The [MASK] id a model reads when no option overrides it, and where it came from: the one
    rule of training and decoding. The config's `mask_token_id` ("config"); for a `wedlm` config
    with `mask_token_id: null`, the released checkpoints' id ("released"; a ConfigError naming
    `source` and the option `how` when the vocabulary does not hold it); else the tokenizer's mask token when it lies inside the
    vocabulary ("tokenizer"); else (None, "none")."""
    from wedlm_jax.config import released_mask_token_id
    if config.mask_token_id is not None:
        return int(config.mask_token_id), "config"
    released = released_mask_token_id(config, source, how)
    if released is not None:
        return released, "released"
    found = None if tok is None else find_mask_token(tok)
    if found is not None and 0 <= found < config.vocab_size:
        return found, "tokenizer"
    return None, "none"


def load_tokenizer(folder, *, error=TokenizerError, hint: str = "") -> Tokenizer:
    """The tokenizer of a checkpoint (or tokenizer) folder. Problems raise `error` (callers pass
    their own error class), a missing tokenizer.json with `hint` appended."""
    from tokenizers import Tokenizer as HFTokenizer
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise error(f"{folder}: no tokenizer.json{hint}")
    try:
        tok = HFTokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises its own Exception type
        raise error(f"{path}: not a tokenizer the `tokenizers` library can read ({e})") from None
    cfg = _read_json(os.path.join(folder, "tokenizer_config.json"), error)
    legacy = _read_json(os.path.join(folder, "special_tokens_map.json"), error)
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = _token_string(cfg[key]) if key in cfg else _token_string(legacy.get(key))
        if value is not None:
            special[key] = str(value)
    template, source = _chat_template(folder, cfg, error)
    eos = _read_json(os.path.join(folder, "generation_config.json"), error).get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return Tokenizer(tok, folder, template, source, special, tuple(int(e) for e in eos))
