"""The batch job's input lines: each JSON line read and checked (fields, settings, prompt, a
constraint compiled) into an Item before any checkpoint loads; every bad line named FILE:LINE and
its field, all in one refusal. Used by the single-process job (decode.jobs.batch_job) and the Ray
job's driver (decode.jobs.ray_job)."""

from __future__ import annotations

import dataclasses
import json
import os

from decode.config import DecodeConfigError, Sampling, prompt_problem
from decode.constraints import spec

SETTINGS = tuple(k for k in Sampling.options() if k != "stop_token_ids")   # a line's own settings
# and the constraint's fields, those decode.constraints.spec.from_fields reads
# and the tool-calling fields (decode.tools: the calls come back in the output line)
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
FIELDS = (("id", "prompt", "messages", "max_tokens", "stop", "model") + SETTINGS + spec.FIELDS
          + TOOL_FIELDS)


@dataclasses.dataclass
class Item:
    """One validated input line."""
    id: object
    line: int
    prompt_ids: list
    sampling: Sampling      # the command line's, overridden by the line's; stop ids: the
                            # default stops + single-token stop strings (the device stops there)
    stop_strings: tuple     # every stop string of the line (checked on the host, text cut before it)
    automaton: object = None  # the line's constraint, compiled (decode.constraints.backends)
    tools: object = None      # the line's tools (decode.tools.ToolRequest): calls read back
    adapter: str | None = None  # the LoRA adapter its `model` names (None: the base model)


@dataclasses.dataclass(frozen=True)
class Rules:
    """What every line is checked against: the job's tokenizer, default settings and stops,
    chat rendering, capacity and vocabulary, the constraint backend and the tool-call format."""
    tokenizer: object
    defaults: Sampling
    base_stop_ids: tuple
    base_stop_strings: tuple
    chat: bool
    capacity: int | None
    vocab_size: int | None
    backend: str = "auto"
    tool_parser: str | None = None
    adapters: tuple = ()          # the job's LoRA adapter names (--lora-modules)
    base_name: str | None = None  # the base model's name a line's `model` may also give


# ----------------------------------------------------------------------------------- input

def id_key(value) -> str:
    return json.dumps(value)


def read_input(path: str, tokenizer, defaults: Sampling, base_stop_ids: list, base_stop_strings: list,
               chat: bool, capacity: int | None, vocab_size: int | None = None,
               backend: str = "auto", tool_parser: str | None = None,
               models: tuple = ((), None)) -> list[Item]:
    """Parse and validate every line; raises one DecodeConfigError naming each bad line's
    `path:line` and field. `backend`: the constraint backend (decode.constraints.backends);
    `tool_parser`: the tool-call format lines with `tools` are read in (decode.tools);
    `models`: (the LoRA adapter names a line's `model` may give, the base model's name)."""
    from decode.text import json_lines
    if not os.path.isfile(path):
        raise DecodeConfigError(f"--input {path}: no such file")
    items = check_records(((path, n, obj) for n, obj in json_lines(path, keep_bad=True)),
                          tokenizer, defaults,
                          base_stop_ids, base_stop_strings, chat, capacity, vocab_size, backend,
                          tool_parser, models)
    if not items:
        raise DecodeConfigError(f"--input {path}: no prompts (every line is blank)")
    return items


MAX_REPORTED = 20     # bad lines listed in one refusal; the rest are counted


def check_records(records, tokenizer, defaults: Sampling, base_stop_ids: list, base_stop_strings: list,
                  chat: bool, capacity: int | None, vocab_size: int | None = None,
                  backend: str = "auto", tool_parser: str | None = None,
                  models: tuple = ((), None)) -> list[Item]:
    """Validate (file, line, object) records, in order: the Items, or one DecodeConfigError
    listing every bad line (`file:line` and the field; the first MAX_REPORTED, then a count).
    An object may be a DecodeConfigError already (a line that is not JSON). An id may appear
    once across all the files."""
    rules = Rules(tokenizer, defaults, tuple(base_stop_ids), tuple(base_stop_strings), chat,
                  capacity, vocab_size, backend, tool_parser, tuple(models[0]), models[1])
    items, seen, errors = [], {}, []
    for name, lineno, obj in records:
        try:
            items.append(_check_record(name, lineno, obj, seen, rules))
        except DecodeConfigError as e:
            errors.append(str(e))
    if errors:
        raise DecodeConfigError(bad_lines_message(errors))
    return items


def bad_lines_message(errors: list[str]) -> str:
    """One bad line: its message; several: a count, then each on its own line (at most
    MAX_REPORTED of them, then how many more)."""
    if len(errors) == 1:
        return errors[0]
    shown = errors[:MAX_REPORTED]
    more = len(errors) - len(shown)
    return "\n".join([f"{len(errors)} bad input lines (each must be fixed):"]
                      + [f"  {e}" for e in shown]
                      + ([f"  ... and {more} more bad lines"] if more else []))


def _record_id(where: str, name: str, lineno: int, obj: dict, seen: dict):
    """The line's id (default: its line number), checked unique; `seen` gains it."""
    rid = obj.get("id", lineno)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise DecodeConfigError(f"{where}: field 'id' must be a string or an int, got {rid!r}")
    if id_key(rid) in seen:
        first = seen[id_key(rid)]
        earlier = f"line {first[1]}" if first[0] == name else f"{first[0]}:{first[1]}"
        raise DecodeConfigError(f"{where}: field 'id' {rid!r} repeats {earlier}")
    seen[id_key(rid)] = (name, lineno)
    return rid


def _check_record(name, lineno, obj, seen: dict, rules: Rules) -> Item:
    """One record's Item, or a DecodeConfigError naming `name:lineno` and the field; `seen`
    (id key: (file, line)) gains its id."""
    where = f"{name}:{lineno}"
    if isinstance(obj, DecodeConfigError):
        raise obj
    if not isinstance(obj, dict):
        raise DecodeConfigError(f"{where}: expected a JSON object with 'prompt' or 'messages', "
                                f"got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise DecodeConfigError(f"{where}: field {unknown[0]!r} is unknown; allowed: "
                                f"{', '.join(FIELDS)}")
    rid = _record_id(where, name, lineno, obj, seen)
    tools = _tools(obj, rules, where)
    ids = _prompt_ids(obj, rules.tokenizer, rules.chat, where, tools)
    problem = prompt_problem(ids, rules.vocab_size, rules.capacity)
    if problem:
        raise DecodeConfigError(f"{where}: field 'prompt': {problem}")
    sampling, stops = _sampling(obj, rules, where)
    return Item(id=rid, line=lineno, prompt_ids=ids, sampling=sampling,
                stop_strings=tuple(dict.fromkeys(list(rules.base_stop_strings) + stops)),
                automaton=_automaton(obj, rules, where, tools), tools=tools,
                adapter=_adapter(obj, rules, where))


def _adapter(obj: dict, rules: Rules, where: str):
    """The LoRA adapter the line's `model` names (None: absent, or the base model's name)."""
    model = obj.get("model")
    if model is None or model == rules.base_name:
        return None
    if model not in rules.adapters:
        known = ", ".join(rules.adapters) or "none: --enable-lora --lora-modules NAME=PATH"
        raise DecodeConfigError(f"{where}: field 'model': {model!r} is not an adapter of the job "
                                f"({known}) or the base model {rules.base_name!r}", "model")
    return model


def _sampling(obj: dict, rules: Rules, where: str):
    """(the line's Sampling: the job's defaults with the line's settings, its stop strings)."""
    from decode.text import split_stop_strings
    if "max_tokens" in obj and "max_new_tokens" in obj:
        raise DecodeConfigError(f"{where}: give one of 'max_tokens' and 'max_new_tokens', not both")
    given = {k: obj[k] for k in SETTINGS if k in obj}
    if "max_tokens" in obj:
        given["max_new_tokens"] = obj["max_tokens"]
    stops = obj.get("stop", [])
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise DecodeConfigError(f"{where}: field 'stop' must be a non-empty string or a list of "
                                f"them, got {obj.get('stop')!r}")
    try:
        one_token, _ = split_stop_strings(rules.tokenizer, stops)
    except DecodeConfigError as e:
        raise DecodeConfigError(f"{where}: field 'stop': {e}") from None
    try:
        sampling = rules.defaults.replace(**given, stop_token_ids=tuple(dict.fromkeys(
            list(rules.base_stop_ids) + one_token)))
    except DecodeConfigError as e:
        field = {"max_new_tokens": "max_tokens" if "max_tokens" in obj else "max_new_tokens",
                 "stop_token_ids": "stop"}.get(e.field, e.field)
        message = str(e).replace(e.field, field, 1) if e.field else str(e)   # the line's own name
        raise DecodeConfigError(f"{where}: field {field!r}: {message}") from None
    return sampling, stops


def _tools(obj: dict, rules: Rules, where: str):
    """The line's ToolRequest (None: no tools); each function's parameters checked by the host
    backend, as the server checks them."""
    from decode.tools.request import checked_tools
    try:
        return checked_tools(obj, rules.tool_parser, True, rules.tokenizer, rules.vocab_size,
                             spec.from_fields(obj) is not None)
    except DecodeConfigError as e:
        raise DecodeConfigError(f"{where}: field {e.field!r}: {e}", e.field) from None


def _automaton(obj: dict, rules: Rules, where: str, tools=None):
    """The line's constraint (its tools' grammar, or its structured-output field) compiled for
    the tokenizer (None: none); errors name the field."""
    from decode.constraints.backends import compile_for
    try:
        constraint = tools.constraint() if tools is not None else None
        constraint = constraint or spec.from_fields(obj)
        return None if constraint is None else compile_for(constraint, rules.tokenizer,
                                                           rules.vocab_size, rules.backend)
    except DecodeConfigError as e:        # its message names the field
        raise DecodeConfigError(f"{where}: {e}", e.field) from None


def _prompt_ids(obj: dict, tokenizer, chat: bool, where: str, tools=None) -> list:
    if ("prompt" in obj) == ("messages" in obj):
        raise DecodeConfigError(f"{where}: give exactly one of the fields 'prompt' and 'messages'")
    if "messages" in obj:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or not msgs
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and (isinstance(m.get("content"), str) or m.get("tool_calls"))
                           for m in msgs)):
            raise DecodeConfigError(f"{where}: field 'messages' must be a non-empty list of "
                                    "{'role': str, 'content': str} objects")
        text = _render(tokenizer, msgs, where, "messages", tools)
        ids = _encode(tokenizer, text, where, "messages")
    else:
        p = obj["prompt"]
        if isinstance(p, str):
            text = _render(tokenizer, [{"role": "user", "content": p}], where, "prompt") if chat else p
            ids = _encode(tokenizer, text, where, "prompt")
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            ids = list(p)
        else:
            raise DecodeConfigError(f"{where}: field 'prompt' must be a string or a list of token ids, got {p!r}")
    if not ids:
        raise DecodeConfigError(f"{where}: field {'messages' if 'messages' in obj else 'prompt'!r} "
                                "encodes to no tokens")
    return ids


def _encode(tokenizer, text: str, where: str, field: str) -> list:
    try:
        return tokenizer.encode(text)
    except ValueError as e:      # wedlm_jax.tokenizer.TextError: not valid Unicode
        raise DecodeConfigError(f"{where}: field {field!r}: {e}") from None


def _render(tokenizer, messages, where, field, tools=None) -> str:
    from decode.tools.request import tool_messages
    try:
        if tools is not None or any("tool_calls" in m or m.get("role") == "tool"
                                    for m in messages):
            messages = tool_messages(messages)
        return tokenizer.apply_chat_template(
            messages, tools=tools.template_tools() if tools is not None else None)
    except DecodeConfigError as e:
        raise DecodeConfigError(f"{where}: field {e.field!r}: {e}") from None
    except ValueError as e:   # no template, or it fails on these messages (ChatTemplateError)
        raise DecodeConfigError(f"{where}: field {field!r}: {e}") from None
