"""Tool calling: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls`, each call's arguments
decoded under its function's `parameters` schema (a host-backend grammar, decode.constraints).

    request.py      the request's tools checked (400s by field), the grammar of what the model
                    may write (`ToolRequest.constraint`), the messages' tool turns checked
    formats.py      the call formats (`--tool-call-parser`): hermes (Qwen, WeDLM), llama3_json;
                    adding one is one `CallFormat` entry
    calls.py        text -> (content, tool calls), whole (`split_calls`) or as streamed deltas
"""

from decode.tools.formats import FORMATS, CallFormat
from decode.tools.request import ToolRequest, parse_tools

__all__ = ["FORMATS", "CallFormat", "ToolRequest", "parse_tools"]
