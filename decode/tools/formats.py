"""How a model writes a tool call: a `CallFormat` per parser name (vLLM's `--tool-call-parser`
names). A call is a JSON object `{"name": ..., <args_key>: {...}}` between `open` and `close`;
parallel calls are joined by `sep`. `trigger` is what switches free text into a call under
`tool_choice: auto` (a lazy lexeme: text before it is free, what follows it is constrained).

    hermes        Qwen2.5/Qwen3 and WeDLM-8B-Instruct: <tool_call>\\n{...}\\n</tool_call>
    llama3_json   Llama 3.1/3.2 JSON calls: {"name": ..., "parameters": {...}}, "; " between
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class CallFormat:
    name: str
    open: str
    close: str
    sep: str
    args_key: str
    trigger: str          # empty: a call stands only at the start of the output

    def lark(self, call_schema: dict, choice: str, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of the output for `choice`: "named": exactly
        one call (OpenAI's semantics for a named function, whatever `parallel` says);
        "required": one call, or several with `parallel`, and the output may end after any of
        them, a separator after the last included (a model that writes the separator out of
        habit can still stop); "auto": free text, or text then calls from the trigger on."""
        call = f"{_lit(self.open)} %json {json.dumps(call_schema)} {_lit(self.close)}"
        more = f' ({_lit(self.sep)} call)*' if parallel and choice != "named" else ""
        if more and choice == "required":
            more += f' ({_lit(self.sep)})?'
        lines = ["%llguidance {}", f"call: {call}", "TEXT: /(.|\\n)*/"]
        if choice != "auto":
            lines.append(f"start: call{more}")
        elif self.trigger:
            rest = self.open[len(self.trigger):]
            first = f"{_lit(rest)} %json {json.dumps(call_schema)} {_lit(self.close)}"
            lines += [f"start: TEXT | opened{more}", f"opened: trig {first}",
                      f"trig[lazy]: TEXT {_lit(self.trigger)}"]
        else:
            lines += [f"start: PLAIN | call{more}", r"PLAIN: /([^{ \n](.|\n)*)?/"]
        return "\n".join(lines) + "\n"

    def first_call(self, text: str) -> int:
        """Where the first call starts in `text` (-1: none yet)."""
        if self.trigger:
            return text.find(self.trigger)
        return 0 if text.lstrip().startswith("{") else -1


def _lit(s: str) -> str:
    return json.dumps(s) if s else ""


FORMATS = {f.name: f for f in (
    CallFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", sep="\n",
               args_key="arguments", trigger="<tool_call>"),
    CallFormat("llama3_json", open="", close="", sep="; ", args_key="parameters", trigger=""),
)}
