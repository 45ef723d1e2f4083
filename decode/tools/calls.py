"""A tool-calling output read back: the text before the first call (the message's content) and
the calls as OpenAI returns them ({id, type, function: {name, arguments}}, arguments as JSON
text), whole (`split_calls`) or as the deltas of a stream (`CallStream`)."""

from __future__ import annotations

import json
import re
import uuid

from decode.tools.formats import CallFormat

_DECODER = json.JSONDecoder()


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _object(fmt: CallFormat, text: str, pos: int):
    """(name, arguments text, end of the JSON object) of the call at `pos`; None while the
    object is incomplete."""
    if not text.startswith(fmt.open, pos):
        return None
    start = pos + len(fmt.open)
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    head = _head(fmt).match(text, start)
    args = text[head.end():end - 1].rstrip(" ") if head else json.dumps(obj.get(fmt.args_key))
    return obj.get("name"), args, end


def _one(fmt: CallFormat, text: str, pos: int):
    """(name, arguments text, end) of the call at `pos` with its closing text; None if it is
    not complete."""
    found = _object(fmt, text, pos)
    if found is None or not text.startswith(fmt.close, found[2]):
        return None
    return found[0], found[1], found[2] + len(fmt.close)


def _head(fmt: CallFormat):
    """The call's JSON up to its arguments (which must have begun: a space is not yet them)."""
    return re.compile(r'\{ *"name" *: *"((?:[^"\\]|\\.)*)" *, *"' + re.escape(fmt.args_key)
                      + r'" *: *(?=[^ ])')


def split_calls(fmt: CallFormat, text: str):
    """(content or None, [call]) of a finished output; no calls when the first is incomplete
    (a budget that ran out inside it: the text is then all content)."""
    first = fmt.first_call(text)
    if first < 0:
        return text, []
    calls, pos = [], first
    while True:
        one = _one(fmt, text, pos)
        if one is None:
            break
        name, args, pos = one
        calls.append({"id": call_id(), "type": "function",
                      "function": {"name": name, "arguments": args}})
        if not text.startswith(fmt.sep, pos):
            break
        pos += len(fmt.sep)
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


class CallStream:
    """Text deltas in, OpenAI `delta` objects out: content until the first call; then each
    call's index, id and name once the name is written, and its arguments as they come (the
    last character held back until the next, since it may close the call)."""

    def __init__(self, fmt: CallFormat):
        self.fmt, self.text = fmt, ""
        self.content_sent, self.first = 0, -1
        self.calls: list = []           # [id, name, args start, args sent]
        self.pos = 0

    def feed(self, delta: str) -> list:
        self.text += delta
        out = []
        if self.first < 0:
            self.first = self.fmt.first_call(self.text)
            upto = self.first if self.first >= 0 else self._safe_content()
            if upto > self.content_sent:
                out.append({"content": self.text[self.content_sent:upto]})
                self.content_sent = upto
            if self.first < 0:
                return out
            self.pos = self.first
        return out + self._calls()

    def _safe_content(self) -> int:
        """How much of the text cannot be the start of a call."""
        trig = self.fmt.trigger
        if not trig:
            return len(self.text) if self.text.strip() else 0
        for k in range(min(len(trig) - 1, len(self.text)), 0, -1):
            if trig.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)

    def _calls(self) -> list:
        out = []
        while True:
            if self.calls and self.calls[-1][3] is None:         # after a call: a separator?
                if not self.text.startswith(self.fmt.sep, self.pos):
                    return out
                self.pos += len(self.fmt.sep)
                self.calls[-1][3] = -1                            # the separator is read
            if not self.calls or self.calls[-1][3] == -1:
                head = self._head()
                if head is None:
                    return out
                out.append(head)
            out += self._arguments()
            done = _one(self.fmt, self.text, self.pos)
            if not done:
                return out
            self.calls[-1][3], self.pos = None, done[2]

    def _head(self):
        """The next call's first delta (index, id, name) once its name is written."""
        at = self.pos + len(self.fmt.open)
        m = _head(self.fmt).match(self.text, at) \
            if self.text.startswith(self.fmt.open, self.pos) else None
        if m is None:
            return None
        self.calls.append([call_id(), json.loads(f'"{m.group(1)}"'), m.end(), 0])
        c = self.calls[-1]
        return {"tool_calls": [{"index": len(self.calls) - 1, "id": c[0], "type": "function",
                                "function": {"name": c[1], "arguments": ""}}]}

    def _arguments(self) -> list:
        """The current call's arguments written since the last delta."""
        obj = _object(self.fmt, self.text, self.pos)
        c = self.calls[-1]
        args = obj[1] if obj else self.text[c[2]:len(self.text) - 1].rstrip(" ")
        if len(args) <= c[3]:
            return []
        delta = args[c[3]:]
        c[3] = len(args)
        return [{"tool_calls": [{"index": len(self.calls) - 1,
                                 "function": {"arguments": delta}}]}]
