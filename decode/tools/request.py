"""A request's tools checked and turned into what decoding needs: the functions for the chat
template, and the grammar of the output (`constraint`) under `tool_choice`. Every error is a
DecodeConfigError naming its field (`tools[0].function.name`, `tool_choice.function.name`,
`messages[3].tool_call_id`): the doors answer it as a 400."""

from __future__ import annotations

import dataclasses
import json
import re

from decode.config import DecodeConfigError
from decode.constraints.spec import Constraint, check_schema
from decode.tools.formats import FORMATS, CallFormat

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}
# a call's JSON written as json.dumps writes it (", " and ": ", no other whitespace): the form
# chat templates render calls in, so the model's own habits and the grammar agree
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
                "lenient": False}


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """The checked tools of one request: `functions` ({name, description, parameters}),
    `choice` ("none" | "auto" | "required" | a function's name), `parallel`, the `fmt`."""
    functions: tuple
    choice: str
    parallel: bool
    fmt: CallFormat

    def template_tools(self) -> list:
        return [{"type": "function", "function": f} for f in self.functions]

    def call_schema(self) -> dict:
        """One call, as JSON: the name among the offered (or the chosen) functions, then the
        arguments under that function's parameters."""
        keep = [f for f in self.functions if self.choice in (*CHOICES, f["name"])]
        one = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  self.fmt.args_key: f["parameters"]},
                "required": ["name", self.fmt.args_key], "additionalProperties": False}
               for f in keep]
        return {"anyOf": one, "x-guidance": JSON_OPTIONS}

    def constraint(self) -> Constraint | None:
        """The output's grammar (None under `none`: free text, no call parsed)."""
        if self.choice == "none":
            return None
        choice = self.choice if self.choice in ("auto", "required") else "named"
        return Constraint.grammar(self.fmt.lark(self.call_schema(), choice, self.parallel),
                                  "tools")


def _function(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise DecodeConfigError(f"{where}: a tool must be an object of type 'function'",
                                f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise DecodeConfigError(f"{where}.function is required (an object)", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise DecodeConfigError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' "
                                f"or '-', got {name!r}", f"{where}.function.name")
    params = fn.get("parameters", NO_PARAMETERS)
    field = f"{where}.function.parameters"
    _parameters(params, field)
    out = {"name": name, "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return out


def _parameters(params, field: str) -> None:
    if not isinstance(params, dict):
        raise DecodeConfigError(f"{field} must be a JSON schema (an object), got "
                                f"{type(params).__name__}", field)
    check_schema(params, field)


def _choice(value, names: list) -> str:
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in CHOICES:
            raise DecodeConfigError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                                    f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                    f"got {value!r}", "tool_choice")
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise DecodeConfigError("tool_choice.function.name is required", "tool_choice")
    if name not in names:
        raise DecodeConfigError(f"tool_choice.function.name: unknown function {name!r} (offered: "
                                f"{', '.join(names)})", "tool_choice.function.name")
    return name


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads `tools` (what a request with tools needs)."""
    return bool(template) and "tools" in template


def parse_tools(body: dict, parser: str | None, auto: bool, template: str | None):
    """The request's ToolRequest (None: no tools). `parser`: the server's --tool-call-parser;
    `auto`: --enable-auto-tool-choice; `template`: the checkpoint's chat template."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise DecodeConfigError("tool_choice needs tools", "tool_choice")
        return None
    if parser is None:
        raise DecodeConfigError(f"tools: this server was started without --tool-call-parser "
                                f"({', '.join(FORMATS)})", "tools")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise DecodeConfigError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise DecodeConfigError(f"tools: the function {dup!r} is given twice", "tools")
    picked = _choice(choice, names)
    if picked == "auto" and not auto:
        raise DecodeConfigError("tool_choice 'auto' needs a server started with "
                                "--enable-auto-tool-choice (use 'required' or a named function)",
                                "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise DecodeConfigError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if not renders_tools(template):
        raise DecodeConfigError("tools: this checkpoint's chat template does not render tools; "
                                "start with --chat-template FILE naming one that does (examples "
                                "for each parser: configs/chat_templates/)", "tools")
    return ToolRequest(tuple(functions), picked, parallel, FORMATS[parser])


def checked_tools(body: dict, parser: str | None, auto: bool, tokenizer, vocab_size,
                  constrained: bool):
    """`parse_tools` at a door: each function's parameters compiled by the host backend (a
    keyword it cannot enforce refused by path), and tools that constrain the output refused
    beside another constraint (`constrained`: the request has a response_format or guided_*)."""
    from decode.constraints.backends import compile_for
    tools = parse_tools(body, parser, auto, getattr(tokenizer, "chat_template", None))
    if tools is None:
        return None
    for i, f in enumerate(tools.functions):
        field = f"tools[{i}].function.parameters"
        compile_for(Constraint.json_schema(f["parameters"], field), tokenizer, vocab_size, "host")
    if tools.constraint() is not None and constrained:
        raise DecodeConfigError("tools: tools with tool_choice other than 'none' already "
                                "constrain the output; drop response_format (or guided_*)",
                                "tools")
    return tools


def tool_messages(messages: list) -> list:
    """`messages` with their tool turns checked: a call has a name and JSON arguments; a tool
    message answers a call made before it (the chat template reads the arguments as objects:
    wedlm_jax.tokenizer)."""
    called, out = set(), []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            m["tool_calls"] = [_call(i, j, c, called) for j, c in enumerate(calls or [])]
        if m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if cid not in called:
                raise DecodeConfigError(f"messages[{i}].tool_call_id {cid!r} answers no earlier "
                                        f"tool call", f"messages[{i}].tool_call_id")
        out.append(m)
    return out


def _call(i: int, j: int, call, called: set) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise DecodeConfigError(f"{where}.function.name is required", f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            json.loads(args or "{}")
        except ValueError:
            raise DecodeConfigError(f"{where}.function.arguments is not JSON",
                                    f"{where}.function.arguments") from None
    if isinstance(call.get("id"), str):
        called.add(call["id"])
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}
