"""The OpenAI protocol of wedlm-serve: request bodies parsed into settings and token ids, and
errors answered with OpenAI's error body. Pure functions of the body (and the tokenizer): nothing
here touches the engine, so a bad request is a 400 naming the field before any device work.
`tests/test_serve_fuzz.py` feeds it arbitrary JSON."""

import dataclasses
import secrets
from typing import Any

from decode.config import MAX_LOGPROBS, DecodeConfigError, Sampling, prompt_problem
from decode.constraints.spec import FIELDS as CONSTRAINT_FIELDS
from decode.constraints.spec import from_fields as constraint_fields
from decode.tools.request import tool_messages
from wedlm_jax.tokenizer import TextError, check_text

MAX_STOP_STRINGS = 8
MAX_BATCH = 64      # prompts in one completions request


# ----------------------------------------------------------------------------------- errors

class APIError(Exception):
    """An error answered with the OpenAI error body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ----------------------------------------------------------------------------------- request parsing

@dataclasses.dataclass
class RequestSettings:
    """A request's settings, validated: its Sampling (the server's defaults, overridden by the
    body; the stop ids come with the prompt) and how the answer is shaped."""
    sampling: Sampling
    max_tokens: int                  # sampling.max_new_tokens, or 0 (echo: score the prompt only)
    stop: list                       # stop strings
    stream: bool
    include_usage: bool
    max_tokens_given: bool = False   # the client named max_tokens (else the server's default)
    logprobs: int | None = None      # completions: the top alternatives per token (0: the token's own)
    echo: bool = False               # completions: the prompt is part of the answer (and scored)
    n: int = 1                       # choices per prompt, each its own request and seed stream
    constraint: Any = None           # decode.constraints.spec.Constraint: what the output matches
    automaton: Any = None            # the constraint compiled for the server's tokenizer
    tools: Any = None                # chat: decode.tools.ToolRequest (calls read back from the text)
    adapter: str | None = None       # the LoRA adapter `model` names (None: the base model)


# a message's fields for tool calling, passed to the chat template (decode.tools.request)
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")
# the Sampling options a request body may set under their own names (max_tokens: parse_settings)
WIRE = Sampling.wire_names()


# Every field a body may carry, per endpoint: OpenAI's that this server reads (or refuses by name
# with its own reason: suffix, functions, best_of other than n, ...), then this server's
# extensions (WeDLM's tau and lam, vLLM's sampling and structured-output fields). Any other field
# is a 400 naming it, as OpenAI answers an unrecognized argument (docs/serving.md lists them).
OPENAI_SHARED = ("model", "stream", "stream_options", "n", "max_tokens", "stop", "temperature",
                 "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user",
                 "logprobs", "response_format")
OPENAI_FIELDS = {
    "completions": OPENAI_SHARED + ("prompt", "echo", "best_of", "suffix",
                                    "top_logprobs", "tools", "tool_choice", "functions"),
    "chat": OPENAI_SHARED + ("messages", "max_completion_tokens", "top_logprobs", "tools",
                             "tool_choice", "parallel_tool_calls", "functions", "suffix", "echo",
                             "best_of")}
EXTENSION_FIELDS = tuple(n for n in WIRE + CONSTRAINT_FIELDS if n not in OPENAI_SHARED)


def check_fields(body: dict, endpoint: str) -> None:
    """A 400 naming the first field `endpoint` ("completions" or "chat") does not accept (a
    `guided_*` name is left to the constraint's parser, which names what it does not implement)."""
    accepted = OPENAI_FIELDS[endpoint] + EXTENSION_FIELDS
    for name in body:
        if name not in accepted and not (isinstance(name, str) and name.startswith("guided_")):
            raise bad(name, f"unrecognized request argument supplied: {name!r}; this endpoint "
                            f"accepts {', '.join(accepted)}", "unknown_parameter")


def _int(body, name, default, low=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"'{name}' must be an integer, got {v!r}", "invalid_type")
    if low is not None and v < low:
        raise bad(name, f"'{name}' must be >= {low}, got {v!r}")
    return v


def _bool(body, name, default=False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {v!r}", "invalid_type")
    return v


def parse_stop(stop) -> list:
    """`stop`: a string or a list of them, none empty, at most MAX_STOP_STRINGS, valid Unicode."""
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", f"'stop' must be a string or a list of strings, got {stop!r}",
                  "invalid_type")
    if any(s == "" for s in stop):
        raise bad("stop", "'stop' strings must not be empty")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' holds {len(stop)} sequences; at most {MAX_STOP_STRINGS}")
    for one in stop:
        try:
            check_text(one, "a stop string")
        except TextError as e:
            raise bad("stop", f"'stop': {e}") from None
    return stop


def parse_settings(body: dict, defaults: Sampling, max_tokens_names=("max_tokens",),
                   scoring: bool = False, chat: bool = False) -> RequestSettings:
    """The settings shared by both endpoints; raises APIError(400) naming the field. `defaults`:
    the server's (its command line); a body's values are checked by Sampling, the one definition
    of their bounds. `scoring`: the completions endpoint, which takes `logprobs`
    (0..MAX_LOGPROBS) and `echo` (with `max_tokens: 0`, the prompt is scored and nothing
    generated). `chat`: the chat endpoint, which takes `logprobs: true` and `top_logprobs`
    (0..MAX_LOGPROBS) for the generated tokens."""
    check_fields(body, "chat" if chat else "completions")
    n = _int(body, "n", 1, 1)
    if body.get("best_of") is not None and _int(body, "best_of", n, 1) != n:
        raise bad("best_of", "'best_of' must equal 'n' (every choice is returned)", "unsupported_value")
    if n > 1 and _bool(body, "stream"):
        raise bad("n", "'n' > 1 with 'stream': true is not supported (ask without streaming)",
                  "unsupported_value")
    unsupported = ("suffix", "functions") if chat else ("suffix", "tools", "functions",
                                                         "tool_choice")
    unsupported += () if chat else ("top_logprobs",) if scoring else ("top_logprobs", "logprobs")
    for name in unsupported:
        if body.get(name) not in (None, False, {}, []):
            raise bad(name, f"'{name}' is not supported by this server", "unsupported_value")
    try:       # response_format, structured_outputs, guided_json / guided_regex / guided_choice
        constraint = constraint_fields(body)
    except DecodeConfigError as e:
        raise bad(e.field, str(e)) from None
    echo = _bool(body, "echo") if scoring else False
    if not scoring and _bool(body, "echo"):
        raise bad("echo", "'echo' is not supported by this endpoint", "unsupported_value")
    logprobs = None
    if scoring and body.get("logprobs") is not None:
        logprobs = _int(body, "logprobs", None, 0)
        if logprobs > MAX_LOGPROBS:
            raise bad("logprobs", f"'logprobs' is at most {MAX_LOGPROBS}, got {logprobs}")
    if chat and _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, 0)
        if logprobs > MAX_LOGPROBS:
            raise bad("top_logprobs", f"'top_logprobs' is at most {MAX_LOGPROBS}, got {logprobs}")
    elif chat and body.get("top_logprobs") is not None:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    if chat and logprobs is not None and _bool(body, "stream"):
        raise bad("logprobs", "'logprobs' with 'stream': true is not supported (ask without streaming)",
                  "unsupported_value")
    if echo and _bool(body, "stream"):
        raise bad("echo", "'echo' with 'stream': true is not supported (score without streaming)",
                  "unsupported_value")
    given, max_tokens_name = {}, max_tokens_names[0]
    for name in max_tokens_names:
        if body.get(name) is not None:
            if not (echo and body[name] == 0 and not isinstance(body[name], bool)):
                given["max_new_tokens"] = body[name]
            max_tokens_name = name
    stop = parse_stop(body.get("stop"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "'stream_options' must be an object", "invalid_type")
    for name in WIRE:
        if body.get(name) is not None:
            given[name] = body[name]
    if type(given.get("top_k")) is int and given["top_k"] == -1:
        given["top_k"] = 0                                    # -1: off (vLLM's)
    try:
        sampling = defaults.replace(**given)
        if "seed" not in given and sampling.temperature > 0:
            sampling = sampling.replace(seed=secrets.randbits(31))
    except DecodeConfigError as e:
        if e.field == "max_new_tokens":
            raise bad(max_tokens_name, str(e).replace("max_new_tokens", max_tokens_name)) from None
        raise bad(e.field, str(e)) from None
    max_given = any(body.get(name) is not None for name in max_tokens_names)
    max_tokens = sampling.max_new_tokens if "max_new_tokens" in given or not max_given else 0
    return RequestSettings(sampling=sampling, max_tokens=max_tokens, stop=stop,
                           stream=_bool(body, "stream"),
                           include_usage=bool(opts and _bool(opts, "include_usage")),
                           max_tokens_given=max_given, logprobs=logprobs, echo=echo, n=n,
                           constraint=constraint)


CHARS_PER_TOKEN_BOUND = 16   # a text this many times longer than the context is checked by a prefix


def encode_within(tokenizer, text: str, context: int | None, param: str = "prompt") -> list:
    """`tokenizer.encode(text)`, except that a text far longer than the context is first judged by
    a prefix: when the first CHARS_PER_TOKEN_BOUND x (context + 2) characters alone make more than
    context + 1 tokens (a prefix's tokens are at most one more than the whole text's), the text
    cannot fit and is refused without tokenizing it all (a multi-megabyte prompt costs
    microseconds, not seconds of the server's CPU)."""
    if context is not None and len(text) > CHARS_PER_TOKEN_BOUND * (context + 2):
        head = encode_text(tokenizer, text[:CHARS_PER_TOKEN_BOUND * (context + 2)], param)
        if len(head) > context + 1:
            raise bad(param, f"the prompt has more than {context} tokens; this server's context is "
                             f"{context} tokens, which leaves no room to generate",
                      "context_length_exceeded")
    return encode_text(tokenizer, text, param)


def encode_text(tokenizer, text: str, param: str) -> list:
    """`tokenizer.encode(text)`; text that is not valid Unicode (a lone surrogate, as a JSON
    escape like \\ud800 decodes to) is a 400 naming `param`."""
    try:
        return tokenizer.encode(text)
    except TextError as e:
        raise bad(param, f"'{param}' {e}") from None


def parse_prompt(body: dict, tokenizer, vocab_size: int, context: int | None = None) -> list:
    """/v1/completions `prompt`: a string, a list of token ids, or a list holding one of those;
    `context`: the server's capacity (a string far beyond it is refused early, `encode_within`)."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "'prompt' is required", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        ids = encode_within(tokenizer, p, context)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        problem = prompt_problem(p, vocab_size)
        if problem:
            raise bad("prompt", f"'prompt': {problem}")
        ids = list(p)
    else:
        raise bad("prompt", "'prompt' must be a string or a list of token ids (one prompt per request)",
                  "invalid_type")
    if not ids:
        raise bad("prompt", "'prompt' encodes to no tokens")
    return ids


def parse_prompts(body: dict, tokenizer, vocab_size: int, max_batch: int,
                  context: int | None = None) -> list:
    """/v1/completions `prompt` as a batch: a string, a list of token ids, or a list of strings /
    of token-id lists (one choice each, in order; at most `max_batch`)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > max_batch:
            raise bad("prompt", f"'prompt' holds {len(p)} prompts; this server takes at most "
                                f"{max_batch} per request")
        out = []
        for i, one in enumerate(p):
            try:
                out.append(parse_prompt({"prompt": one}, tokenizer, vocab_size, context))
            except APIError as e:
                raise bad("prompt", f"prompt {i} of the batch: {e.message}", e.code) from None
        return out
    return [parse_prompt(body, tokenizer, vocab_size, context)]


def parse_tokenize(body: dict, tokenizer) -> list:
    """POST /tokenize (vLLM's shape, what lm-eval's remote tokenizer sends): `prompt` (a string) or
    `messages` (through the chat template, `add_generation_prompt` default true) -> token ids.
    `add_special_tokens` is accepted; this server's tokenizers add none either way."""
    _bool(body, "add_special_tokens")
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise bad("prompt", "give 'prompt' or 'messages', not both")
        return parse_messages(body, tokenizer, _bool(body, "add_generation_prompt", True),
                              allow_empty=True)
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "'prompt' (a string) or 'messages' is required", "missing_required_parameter")
    if not isinstance(p, str):
        raise bad("prompt", f"'prompt' must be a string, got {type(p).__name__}", "invalid_type")
    return encode_text(tokenizer, p, "prompt")


def parse_detokenize(body: dict, vocab_size: int) -> list:
    """POST /detokenize: `tokens`, a list of token ids in the vocabulary."""
    t = body.get("tokens")
    if t is None:
        raise bad("tokens", "'tokens' is required", "missing_required_parameter")
    if not isinstance(t, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in t):
        raise bad("tokens", "'tokens' must be a list of integer token ids", "invalid_type")
    for j, x in enumerate(t):
        if not 0 <= x < vocab_size:
            raise bad("tokens", f"'tokens' ids must be in [0, {vocab_size}); token {j} is {x}")
    return t


def parse_messages(body: dict, tokenizer, add_generation_prompt: bool = True,
                   allow_empty: bool = False, context: int | None = None, tools=None) -> list:
    """/v1/chat/completions `messages` through the checkpoint's chat template -> prompt ids;
    `tools`: the functions the template renders (decode.tools)."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list", "invalid_type")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}].role", f"messages[{i}] needs a string 'role'", "invalid_type")
        content = m.get("content")
        if content is None and m.get("tool_calls"):      # an assistant turn of calls alone
            content = ""
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported", "invalid_type")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string", "invalid_type")
        clean.append({"role": m["role"], "content": content,
                      **{k: m[k] for k in TOOL_FIELDS if m.get(k) is not None}})
    if not tokenizer.chat_template:
        raise bad("messages", "this checkpoint has no chat template; use /v1/completions")
    try:
        if tools is not None or any(len(m) > 2 for m in clean):
            clean = tool_messages(clean)
        text = tokenizer.apply_chat_template(clean, add_generation_prompt, tools=tools)
    except DecodeConfigError as e:
        raise bad(e.field, str(e)) from None
    except ValueError as e:   # the template refuses these messages (ChatTemplateError)
        raise bad("messages", str(e)) from None
    ids = encode_within(tokenizer, text, context, "messages")
    if not ids and not allow_empty:
        raise bad("messages", "'messages' encode to no tokens")
    return ids


# ----------------------------------------------------------------------------------- answers

def generated_scores(logprobs: list, n_out: int, top_n: int) -> dict:
    """decode.serving.scoring's shape for the first `n_out` generated tokens from what their decoding
    carried (`Finished.logprobs`: per token (log-probability, {id: log-probability} of the
    likeliest, best first)), the alternatives cut to `top_n`."""
    picked = logprobs[:n_out]
    return {"token_logprobs": [lp for lp, _ in picked],
            "top_logprobs": [dict(list(top.items())[:top_n]) for _, top in picked]}


def logprobs_object(tokenizer, seq: list, scored: dict, start: int, top_n: int) -> dict:
    """OpenAI's completions `logprobs` for seq[start:]: token strings, their log-probabilities
    (null for the sequence's first token), the top alternatives, and character offsets into
    the returned text (which starts at seq[start])."""
    pieces = [tokenizer.decode([t]) for t in seq]
    ends = [0]
    for piece in pieces:
        ends.append(ends[-1] + len(piece))
    if "".join(pieces) != tokenizer.decode(seq):   # a character split across tokens: decode prefixes
        ends = [len(tokenizer.decode(seq[:j])) for j in range(len(seq) + 1)]
    top = None
    if top_n:
        top = [None if d is None else {tokenizer.decode([t]): v for t, v in d.items()}
               for d in scored["top_logprobs"][start:]]
    return {"tokens": pieces[start:], "token_logprobs": scored["token_logprobs"][start:],
            "top_logprobs": top, "text_offset": [ends[j] - ends[start] for j in range(start, len(seq))]}


def chat_logprobs_object(tokenizer, seq: list, scored: dict, start: int, top_n: int) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]} for the
    generated tokens seq[start:]."""
    def entry(t, lp):
        piece = tokenizer.decode([t])
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}
    content = []
    for j in range(start, len(seq)):
        e = entry(seq[j], scored["token_logprobs"][j])
        e["top_logprobs"] = ([entry(t, v) for t, v in scored["top_logprobs"][j].items()]
                             if top_n else [])
        content.append(e)
    return {"content": content}


def field_of(e: DecodeConfigError, default: str) -> str:
    """The request field a DecodeConfigError names (`e.field`, in the body's words); `default`
    (the prompt's or the messages' field) for the prompt or when it names none."""
    if e.field in (None, "prompt"):
        return default
    if e.field == "top_logprobs":
        return "top_logprobs" if default == "messages" else "logprobs"
    return {"max_new_tokens": "max_tokens", "stop_token_ids": "stop"}.get(e.field, e.field)
