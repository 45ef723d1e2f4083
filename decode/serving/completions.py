"""The completion endpoints of wedlm-serve (`/v1/completions`, `/v1/chat/completions`): a request
checked against the server's context, submitted to the engine thread, and its tokens read back
through one token loop (`Completions.events`), which the JSON answer (`collect`) and the server-sent
events (`stream`) both use. The routes are `decode/serving/app.py`'s; the protocol `decode/serving/protocol.py`'s.

Imported when the app is built (fastapi is the serve extra).
"""

import asyncio
import dataclasses
import json
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from decode.config import MAX_LOGPROBS, MAX_STOP_IDS, DecodeConfigError, Sampling
from decode.constraints.backends import allowed_alternatives, compile_for
from decode.engine.step.state import Request
from decode.engine.runtime.adapters import AdapterNotFound
from decode.serving.lora_routes import model_of, not_found
from decode.serving.worker import Busy
from decode.serving.protocol import (MAX_BATCH, APIError, RequestSettings, bad,
                                     chat_logprobs_object, field_of, generated_scores,
                                     logprobs_object, parse_messages, parse_prompts, parse_settings)
from decode.text import TextStream, split_stop_strings
from decode.tools.calls import CallStream, split_calls
from decode.tools.request import checked_tools

DISCONNECT_POLL_S = 0.25   # how often a non-streaming request looks whether its client is still there


def usage(n_prompt: int, n_out: int, fin=None) -> dict:
    out = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if fin is not None and fin.cached_tokens:   # prefix reuse (--page-size)
        out["prompt_tokens_details"] = {"cached_tokens": fin.cached_tokens}
    return out


def stats(fin, n_out: int):
    if fin is None:
        return None
    return {"steps": fin.steps, "token_slots": fin.n_fwd,      # steps: forwards
            "p_cache": n_out / fin.n_fwd if fin.n_fwd else 0.0}


def seeded(s: RequestSettings, k: int) -> RequestSettings:
    """Choice k of a request's `n`: its own seed stream (the request's seed + k)."""
    if k == 0:
        return s
    return dataclasses.replace(s, sampling=s.sampling.replace(seed=(s.sampling.seed + k) % (1 << 32)))


def sse(obj) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return "data: " + json.dumps(obj) + "\n\n"


class Completions:
    """The completion endpoints over a started `decode.serving.worker.EngineThread`, its tokenizer
    and the server's `decode.serving.app.ServerConfig`."""

    def __init__(self, engine, tokenizer, cfg):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg

    # ------------------------------------------------------------------------------- the routes

    def check_n(self, s: RequestSettings) -> None:
        """`n` choices run at once, one slot each: at most the server's slots."""
        if self.cfg.slots and s.n > self.cfg.slots:
            raise bad("n", f"'n' is at most this server's {self.cfg.slots} slots, got {s.n}")

    def with_adapter(self, body: dict, s: RequestSettings) -> RequestSettings:
        """`s` with the LoRA adapter its `model` names (a 404 for an unknown name); prompt
        scoring (`echo` with `logprobs`) reads the base model only."""
        adapter = model_of(body, self.cfg)
        if adapter is not None and s.echo and s.logprobs is not None:
            raise bad("echo", "prompt log-probabilities (echo with logprobs) are the base "
                              f"model's; not served under the LoRA adapter {adapter!r}")
        return dataclasses.replace(s, adapter=adapter)

    async def completions(self, http, body: dict):
        s = self.with_adapter(body, parse_settings(body, self.cfg.defaults, scoring=True))
        s = await self.compiled(s)
        self.check_n(s)
        prompts = await asyncio.to_thread(parse_prompts, body, self.tokenizer, self.cfg.vocab_size,
                                          MAX_BATCH, self.cfg.capacity)               # off the loop
        if len(prompts) == 1 and s.logprobs is None and not s.echo and s.n == 1:
            return await self.run(http, prompts[0], s, chat=False, param="prompt")
        if s.stream:
            raise bad("stream", "'stream': true takes one prompt without 'logprobs' or 'echo'",
                      "unsupported_value")
        return await self.scored_choices(http, prompts, s)

    async def chat_completions(self, http, body: dict):
        s = self.with_adapter(body, parse_settings(
            body, self.cfg.defaults, ("max_tokens", "max_completion_tokens"), chat=True))
        s = await self.compiled(await asyncio.to_thread(self.with_tools, body, s))
        self.check_n(s)
        tools = s.tools.template_tools() if s.tools is not None else None
        ids = await asyncio.to_thread(parse_messages, body, self.tokenizer, True, False,
                                      self.cfg.capacity, tools)                       # off the loop
        return await self.run(http, ids, s, chat=True, param="messages")

    def with_tools(self, body: dict, s: RequestSettings) -> RequestSettings:
        """`s` with the request's tools (decode.tools) and, unless tool_choice is 'none', their
        grammar as its constraint; each function's parameters checked by the host backend."""
        try:
            tools = checked_tools(body, self.cfg.tool_parser, self.cfg.auto_tool_choice,
                                  self.tokenizer, self.cfg.vocab_size, s.constraint is not None)
        except DecodeConfigError as e:
            raise bad(e.field, str(e)) from None
        if tools is None:
            return s
        return dataclasses.replace(s, tools=tools, constraint=tools.constraint() or s.constraint)

    # ------------------------------------------------------------------ a request to the engine

    async def compiled(self, s: RequestSettings) -> RequestSettings:
        """`s` with its constraint compiled for the tokenizer (off the loop; cached by the
        constraint's hash), before any admission; a constraint that cannot be is a 400."""
        if s.constraint is None:
            return s
        try:
            auto = await asyncio.to_thread(compile_for, s.constraint, self.tokenizer,
                                           self.cfg.vocab_size, self.cfg.constraint_backend)
        except DecodeConfigError as e:
            raise bad(e.field, str(e)) from None
        return dataclasses.replace(s, automaton=auto)

    def make_request(self, ids: list, s: RequestSettings, param: str) -> Request:
        """OpenAI's / vLLM's lengths: a prompt that leaves no room, or a named max_tokens that does
        not fit beside it, is a 400 context_length_exceeded; the server's default max_tokens is
        cut to the room left."""
        cfg = self.cfg
        if s.logprobs is not None and s.logprobs > cfg.max_logprobs and s.max_tokens > 0:
            field = "top_logprobs" if param == "messages" else "logprobs"
            raise bad(field, f"generated tokens carry at most {cfg.max_logprobs} alternatives on this "
                             f"server (--max-logprobs), got {s.logprobs}; prompt scoring alone "
                             f"(echo with max_tokens 0) takes up to {MAX_LOGPROBS}")
        if len(ids) >= cfg.capacity:
            raise bad(param, f"the prompt has {len(ids)} tokens; this server's context is "
                             f"{cfg.capacity} tokens, which leaves no room to generate",
                      "context_length_exceeded")
        room = cfg.capacity - len(ids)
        if s.max_tokens > room:
            if s.max_tokens_given:
                raise bad("max_tokens", f"this server's context is {cfg.capacity} tokens; the prompt "
                                        f"has {len(ids)} and max_tokens asks for {s.max_tokens} more "
                                        f"({len(ids) + s.max_tokens}); at most {room}",
                          "context_length_exceeded")
            s = dataclasses.replace(s, max_tokens=room)
        try:
            one_token, _ = split_stop_strings(self.tokenizer, s.stop)
        except DecodeConfigError as e:
            raise bad("stop", str(e)) from None
        stop_ids = tuple(dict.fromkeys(list(cfg.default_stop_ids) + one_token))
        if len(stop_ids) > MAX_STOP_IDS:
            raise bad("stop", f"too many stop sequences: {len(stop_ids)} stop token ids with the "
                              f"defaults, at most {MAX_STOP_IDS}")
        try:
            return Request(prompt=tuple(ids), **Sampling.pick(s.sampling.replace(
                max_new_tokens=s.max_tokens, stop_token_ids=stop_ids)), top_logprobs=s.logprobs or 0,
                automaton=s.automaton)
        except DecodeConfigError as e:
            raise bad(field_of(e, param), str(e)) from None

    def submit(self, request: Request, param: str, adapter: str | None = None):
        """-> (request id, asyncio queue of ('tokens', ids) / ('finish', Finished) / ('error', msg));
        `adapter`: the LoRA adapter it decodes with."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)
        try:
            rid = self.engine.submit(request, on_tokens=lambda _rid, ids: put(("tokens", list(ids))),
                                     on_finish=lambda fin: put(("finish", fin)),
                                     on_error=lambda msg, status=500: put(("error", (status, msg))),
                                     adapter=adapter)
        except Busy:
            raise APIError(429, f"the server is busy ({self.engine.max_pending} requests in flight); "
                                "retry", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except AdapterNotFound:          # unloaded since the body was read
            raise not_found(adapter) from None
        except DecodeConfigError as e:
            raise bad(field_of(e, param), str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error", code="unavailable",
                           headers={"Retry-After": "5"}) from None
        return rid, q

    # ------------------------------------------------------------------------- the token loop

    async def events(self, rid: int, q: asyncio.Queue, text: TextStream, http=None):
        """The one token loop of request `rid`: its queue read into `text` (a stop string cancels
        the request), as events:

            ('text', delta)          new text (never empty)
            ('done', (reason, fin))  the finish reason and Finished (after a stop string too: the
                                     request is cancelled and its Finished awaited, so every
                                     answer carries its statistics and log-probabilities)
            ('failed', message)      the request failed in the engine (the server goes on)
            ('error', APIError)      the engine failed or is stopping
            ('gone', None)           `http`'s client went away (when `http` is given, polled
                                     every DISCONNECT_POLL_S whether tokens arrive or not; the
                                     request is cancelled)

        one of the last four ends it."""
        poll_at = time.monotonic() + DISCONNECT_POLL_S
        while True:
            if http is None:
                kind, val = await q.get()
            else:
                try:
                    kind, val = await asyncio.wait_for(
                        q.get(), timeout=max(poll_at - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    kind = None
                if time.monotonic() >= poll_at:   # a busy request is polled too, between tokens
                    poll_at = time.monotonic() + DISCONNECT_POLL_S
                    if await http.is_disconnected():
                        self.engine.cancel(rid)
                        yield "gone", None
                        return
                if kind is None:
                    continue
            if kind == "tokens":
                delta = text.add(val)
                if delta:
                    yield "text", delta
                if text.stopped:
                    self.engine.cancel(rid, reason="stop")
            elif kind == "finish" and val.finish == "error":
                yield "failed", f"request {rid} failed in the engine ({val.error}); the server goes on"
                return
            elif kind == "finish":
                if not text.stopped and len(text.ids) < len(val.tokens):  # tokens not yet handed out
                    text.add(val.tokens[len(text.ids):])
                delta = text.finish()
                if delta:
                    yield "text", delta
                yield "done", ("stop" if text.stopped else val.finish, val)
                return
            else:
                status, msg = val
                yield "error", APIError(status, msg, type="server_error",
                                        code="engine_failed" if status == 500 else "unavailable")
                return

    async def collect(self, http, rid: int, q: asyncio.Queue, text: TextStream):
        """A request's tokens until it finishes: (text, finish reason, Finished); the reason is
        None when the client went away (the request is cancelled)."""
        try:
            async for kind, val in self.events(rid, q, text, http):
                if kind == "done":
                    reason, fin = val
                    return text, reason, fin
                if kind == "gone":
                    return text, None, None
                if kind == "failed":
                    raise APIError(500, val, type="server_error", code="request_failed")
                if kind == "error":
                    raise val
        except asyncio.CancelledError:
            self.engine.cancel(rid)
            raise

    async def stream(self, rid: int, q: asyncio.Queue, text: TextStream, head: dict,
                     s: RequestSettings, chat: bool, n_prompt: int):
        """The server-sent events of a request: its text as chunks, then the finish reason (or
        the error), the usage when asked, and [DONE]."""
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta=None, reason=None, **extra):
            if chat:
                d = {} if delta is None else ({"content": delta} if not isinstance(delta, dict) else delta)
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            return sse(dict(head, object=obj, choices=[choice], **extra))

        done = False
        calls = (CallStream(s.tools.fmt) if chat and s.tools is not None
                 and s.tools.choice != "none" else None)
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            async for kind, val in self.events(rid, q, text):
                if kind == "text":
                    for delta in (calls.feed(val) if calls is not None else [val]):
                        yield chunk(delta)
                    continue
                if kind == "failed":
                    yield sse(APIError(500, val, type="server_error").body())
                elif kind == "error":
                    yield sse(val.body())
                done = True
                if kind == "done":
                    reason, fin = val
                    if calls is not None and calls.calls and reason == "stop":
                        reason = "tool_calls"
                    yield chunk(None, reason, wedlm=stats(fin, text.n_used))
                    if s.include_usage:
                        yield sse(dict(head, object=obj, choices=[],
                                       usage=usage(n_prompt, text.n_used, fin)))
            yield "data: [DONE]\n\n"
        finally:
            if not done:   # the client went away (or the server is stopping): free the slot
                self.engine.cancel(rid)

    # ------------------------------------------------------------------------------ the answers

    async def run(self, http, ids: list, s: RequestSettings, chat: bool, param: str):
        """One prompt, generated: streamed, or answered whole with its `n` choices."""
        head = dict(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                    model=s.adapter or self.cfg.model_name)
        if s.stream:
            rid, q = self.submit(self.make_request(ids, s, param), param, s.adapter)
            text = TextStream(self.tokenizer, s.stop)
            return StreamingResponse(self.stream(rid, q, text, head, s, chat, len(ids)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        requests = [self.make_request(ids, seeded(s, k), param) for k in range(s.n)]
        results = await asyncio.gather(*(self.one_choice(http, k, ids, r, s, chat, param)
                                         for k, r in enumerate(requests)))
        if any(r is None for r in results):
            return JSONResponse({}, status_code=499)
        n_out, fin = sum(r[1] for r in results), results[0][2]
        return JSONResponse(dict(head, object="chat.completion" if chat else "text_completion",
                                 choices=[r[0] for r in results], usage=usage(len(ids), n_out, fin),
                                 wedlm=stats(fin, results[0][1])))

    async def one_choice(self, http, k: int, ids: list, request: Request, s: RequestSettings,
                         chat: bool, param: str):
        """-> (choice k, its completion tokens, Finished) of one prompt; None when the client
        went away."""
        rid, q = self.submit(request, param, s.adapter)
        text, reason, fin = await self.collect(http, rid, q, TextStream(self.tokenizer, s.stop))
        if reason is None:
            return None
        n_out = text.n_used
        message = {"role": "assistant", "content": text.sent}
        if chat and s.tools is not None and s.tools.choice != "none":
            message["content"], calls = split_calls(s.tools.fmt, text.sent)
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        choice = ({"index": k, "message": message,
                   "logprobs": None, "finish_reason": reason} if chat else
                  {"index": k, "text": text.sent, "logprobs": None, "finish_reason": reason})
        if chat and s.logprobs is not None:
            seq = list(ids) + list(text.ids[:n_out])
            scored = await self.sequence_scores(ids, fin, n_out, s.logprobs, False, s.automaton)
            choice["logprobs"] = await asyncio.to_thread(chat_logprobs_object, self.tokenizer, seq,
                                                          scored, len(ids), s.logprobs)
        return choice, n_out, fin

    async def scored_choices(self, http, prompts: list, s: RequestSettings):
        """/v1/completions with `echo`, `logprobs` or several prompts: one choice per prompt (each
        generated as its own request through the engine; the prompt scored by the AR reading
        when echoed, the completion's log-probabilities as its decoding carried them)."""
        results = await asyncio.gather(*(self.scored_choice(http, i * s.n + k, ids, seeded(s, k))
                                         for i, ids in enumerate(prompts) for k in range(s.n)))
        if any(r is None for r in results):
            return JSONResponse({}, status_code=499)
        n_prompt, n_out = sum(r[1] for r in results), sum(r[2] for r in results)
        head = dict(id="cmpl-" + uuid.uuid4().hex, created=int(time.time()),
                    model=s.adapter or self.cfg.model_name)
        return JSONResponse(dict(head, object="text_completion", choices=[r[0] for r in results],
                                 usage=usage(n_prompt, n_out)))

    async def scored_choice(self, http, i: int, ids: list, s: RequestSettings):
        """-> (choice, prompt tokens, completion tokens, Finished) of prompt `i`; None when the
        client went away."""
        out, sent, reason, fin = [], "", "length", None
        if s.max_tokens > 0:
            rid, q = self.submit(self.make_request(ids, s, "prompt"), "prompt", s.adapter)
            text, reason, fin = await self.collect(http, rid, q, TextStream(self.tokenizer, s.stop))
            if reason is None:
                return None
            out, sent = text.ids[:text.n_used], text.sent
        choice = {"index": i, "text": (self.tokenizer.decode(ids) if s.echo else "") + sent,
                  "logprobs": None, "finish_reason": reason}
        if s.logprobs is not None:
            seq = list(ids) + list(out)
            scored = await self.sequence_scores(ids, fin, len(out), s.logprobs, s.echo,
                                                s.automaton)
            choice["logprobs"] = await asyncio.to_thread(logprobs_object, self.tokenizer, seq, scored,
                                                         0 if s.echo else len(ids), s.logprobs)
        return choice, len(ids), len(out), fin

    # -------------------------------------------------------------------------------- scoring

    async def engine_score(self, sequences, top_n: int) -> list:
        """The AR reading's log-probabilities of `sequences`, computed on the engine thread."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(result):
            if fut.done():
                return
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)
        try:
            self.engine.score(sequences, top_n, lambda r: loop.call_soon_threadsafe(settle, r))
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error", code="unavailable",
                           headers={"Retry-After": "5"}) from None
        try:
            return await fut
        except DecodeConfigError as e:
            raise bad("prompt", str(e)) from None

    async def sequence_scores(self, ids, fin, n_out: int, top_n: int, echo: bool,
                              automaton=None) -> dict:
        """`scored` (decode.serving.scoring's shape) for prompt + the first n_out generated tokens: the
        prompt's by the AR reading on the engine thread when `echo` (else None entries), the
        generated tokens' as the decoding carried them (docs/algorithm.md §6), under a
        constraint without the alternatives it forbade."""
        prompt = ((await self.engine_score([list(ids)], top_n))[0] if echo else
                  {"token_logprobs": [None] * len(ids), "top_logprobs": [None] * len(ids)})
        gen = generated_scores(fin.logprobs if fin is not None else [], n_out, top_n)
        if automaton is not None and fin is not None:
            gen["top_logprobs"] = await asyncio.to_thread(
                allowed_alternatives, automaton, self.cfg.default_stop_ids, list(fin.tokens),
                gen["top_logprobs"])
        return {k: list(prompt[k]) + gen[k] for k in ("token_logprobs", "top_logprobs")}
