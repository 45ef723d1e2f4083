"""wedlm-serve: an OpenAI-compatible HTTP server over the continuous batcher (issue 13 item 5).

    wedlm-serve --checkpoint DIR [--host 127.0.0.1 --port 8000 --slots 16 --method streaming
                                  --window 16 --api-key KEY]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template),
GET /v1/models, GET /health. `stream: true` answers with server-sent events in the OpenAI chunk
format ending with `data: [DONE]` (`stream_options: {"include_usage": true}` adds the usage chunk);
other answers carry `usage`. Request settings: max_tokens (chat: or max_completion_tokens),
temperature, top_p, top_k, seed, stop (a string or up to MAX_STOP_STRINGS strings) and WeDLM's
`tau` and `lam`; method, window, slots and capacity are the server's. Answers also carry a `wedlm`
object (steps, n_fwd, p_cache).

Design: ONE engine thread owns the device and calls `Batcher.step()` (one jitted chunk of steps);
the HTTP handlers (uvicorn's event loop) only submit, cancel and read the tokens the engine thread
hands over through `loop.call_soon_threadsafe`. At most slots + --max-queue requests are admitted
(beyond: 429 with Retry-After). A client that disconnects is cancelled (its slot is freed at the
next step boundary). Stop strings are matched on the host: the text is cut before the string, the
request cancelled; single-token stop strings also stop the slot on the device. A bad request gets
400 with an OpenAI error body naming the field before anything reaches the engine. With --api-key
(or WEDLM_API_KEY) every /v1 request needs `Authorization: Bearer KEY` (401 otherwise); /health
stays open for probes. SIGTERM: stop accepting, let in-flight requests finish (cancel what is left
after --shutdown-timeout seconds), stop the engine, exit 0.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import uuid

from decode.config import MAX_STOP_IDS, DecodeConfigError

MAX_STOP_STRINGS = 8
API_KEY_ENV = "WEDLM_API_KEY"
log = logging.getLogger("wedlm-serve")


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
class Settings:
    """A request's generation settings, validated."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    tau: float
    lam: float
    stop: list
    stream: bool
    include_usage: bool
    max_tokens_given: bool = False   # the client named max_tokens (else the server's default)


def _number(body, name, default, low=None, high=None, low_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise bad(name, f"'{name}' must be a number, got {v!r}", "invalid_type")
    if low is not None and (v <= low if low_open else v < low):
        raise bad(name, f"'{name}' must be {'>' if low_open else '>='} {low}, got {v!r}")
    if high is not None and v > high:
        raise bad(name, f"'{name}' must be <= {high}, got {v!r}")
    return float(v)


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


def parse_settings(body: dict, default_max_tokens: int, max_tokens_names=("max_tokens",)) -> Settings:
    """The settings shared by both endpoints; raises APIError(400) naming the field."""
    for name, allowed in (("n", 1), ("best_of", 1)):
        if body.get(name) is not None and _int(body, name, 1, 1) != allowed:
            raise bad(name, f"'{name}' must be {allowed} (one choice per request)", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise bad(name, f"'{name}' is not supported (must be 0)", "unsupported_value")
    for name in ("logprobs", "top_logprobs", "logit_bias", "suffix", "tools", "functions"):
        if body.get(name) not in (None, False, {}, []):
            raise bad(name, f"'{name}' is not supported by this server", "unsupported_value")
    if _bool(body, "echo"):
        raise bad("echo", "'echo' is not supported by this server", "unsupported_value")
    max_tokens, given = default_max_tokens, False
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens, given = _int(body, name, None, 1), True
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", f"'stop' must be a string or a list of strings, got {body.get('stop')!r}",
                  "invalid_type")
    if any(s == "" for s in stop):
        raise bad("stop", "'stop' strings must not be empty")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' holds {len(stop)} sequences; at most {MAX_STOP_STRINGS}")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "'stream_options' must be an object", "invalid_type")
    temperature = _number(body, "temperature", 0.0, 0.0)
    seed = _int(body, "seed", None)
    if seed is None:
        seed = secrets.randbits(31) if temperature > 0 else 0
    return Settings(max_tokens=max_tokens, temperature=temperature,
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    top_k=max(0, _int(body, "top_k", 0, -1)), seed=seed,   # -1: off (vLLM's)
                    tau=_number(body, "tau", None, 0.0), lam=_number(body, "lam", None, 0.0),
                    stop=stop, stream=_bool(body, "stream"),
                    include_usage=bool(opts and _bool(opts, "include_usage")),
                    max_tokens_given=given)


def parse_prompt(body: dict, tokenizer, vocab_size: int) -> list:
    """/v1/completions `prompt`: a string, a list of token ids, or a list holding one of those."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "'prompt' is required", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        ids = tokenizer.encode(p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < vocab_size for t in p):
            raise bad("prompt", f"'prompt' token ids must be in [0, {vocab_size})")
        ids = list(p)
    else:
        raise bad("prompt", "'prompt' must be a string or a list of token ids (one prompt per request)",
                  "invalid_type")
    if not ids:
        raise bad("prompt", "'prompt' encodes to no tokens")
    return ids


def parse_messages(body: dict, tokenizer) -> list:
    """/v1/chat/completions `messages` through the checkpoint's chat template -> prompt ids."""
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
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported", "invalid_type")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string", "invalid_type")
        clean.append({"role": m["role"], "content": content})
    if not tokenizer.chat_template:
        raise bad("messages", "this checkpoint has no chat template; use /v1/completions")
    try:
        ids = tokenizer.encode(tokenizer.apply_chat_template(clean))
    except ValueError as e:   # the template refuses these messages (ChatTemplateError)
        raise bad("messages", str(e)) from None
    if not ids:
        raise bad("messages", "'messages' encode to no tokens")
    return ids


# ----------------------------------------------------------------------------------- text

def first_stop(text: str, stops) -> int:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


class TextStream:
    """Token ids in, text deltas out: holds back an incomplete UTF-8 tail and any tail that may be
    the start of a stop string; cuts the text before the first stop string."""

    def __init__(self, tokenizer, stops):
        self.tok, self.stops = tokenizer, list(stops)
        self.ids: list = []
        self.sent = ""
        self.stopped = False
        self.n_used = 0   # completion tokens (through the one that completed a stop string)

    def add(self, new) -> str:
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
        return "" if self.stopped else self._emit(self.tok.decode(self.ids))

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


# ----------------------------------------------------------------------------------- the engine

class Busy(Exception):
    pass


def _guarded(callback):
    """A callback that never raises into `Batcher.step()` (a handler whose event loop has already
    closed, at shutdown, must not take the engine down with it)."""
    def call(*a):
        try:
            callback(*a)
        except Exception:   # noqa: BLE001 - logged; the engine and the other requests go on
            log.warning("a request callback failed", exc_info=True)
    return call


class Engine:
    """The one thread that owns the device: admits requests (bounded), calls `Batcher.step()`,
    and hands tokens and finishes to the callbacks (which must be cheap and thread-safe)."""

    def __init__(self, batcher, max_pending: int):
        self.batcher = batcher
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._live: dict = {}            # request id -> on_error(message)
        self._early: set = set()         # ids whose finish came before submit() registered them
        self._pending = 0
        self._accepting = True
        self._stop = False
        self.error: str | None = None
        self.steps = 0
        self.finished = {"stop": 0, "length": 0, "cancelled": 0}
        self._thread = threading.Thread(target=self._loop, name="wedlm-engine", daemon=True)

    def start(self):
        self._thread.start()
        return self

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def accepting(self) -> bool:
        return self._accepting and self.error is None

    def submit(self, request, on_tokens, on_finish, on_error) -> int:
        """Raises Busy (queue full), RuntimeError (not accepting) or DecodeConfigError. The Batcher
        is never called under this engine's lock (its callbacks take that lock: no lock-order cycle)."""
        with self._lock:
            if not self.accepting:
                raise RuntimeError(self.error or "the server is shutting down")
            if self._pending >= self.max_pending:
                raise Busy()
            self._pending += 1
        try:
            rid = self.batcher.submit(request, on_tokens=_guarded(on_tokens),
                                      on_finish=lambda fin: self._finished(fin, _guarded(on_finish)))
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        with self._lock:
            if rid in self._early:        # finished before we got here
                self._early.discard(rid)
            else:
                self._live[rid] = on_error
        self._wake.set()
        return rid

    def cancel(self, rid: int) -> None:
        with self._lock:
            live = rid in self._live
        if live:
            self.batcher.cancel(rid)
            self._wake.set()

    def _finished(self, fin, on_finish):
        with self._lock:
            if self._live.pop(fin.request_id, None) is None:
                self._early.add(fin.request_id)
            self._pending -= 1
            self.finished[fin.finish] = self.finished.get(fin.finish, 0) + 1
        on_finish(fin)

    def _loop(self):
        while True:
            with self._lock:
                if self._stop and self._pending == 0:
                    return
                busy = self._pending > 0
            if not busy:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                self.batcher.step()
                self.steps += 1
            except Exception as e:  # the device failed: answer everyone, accept nothing more
                log.exception("engine step failed")
                with self._lock:
                    self.error = f"the decoding engine failed: {type(e).__name__}: {e}"
                    live, self._live, self._pending = self._live, {}, 0
                for on_error in live.values():
                    on_error(self.error)
                return

    def stop_accepting(self):
        with self._lock:
            self._accepting = False

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; cancel what is still in flight; stop the thread (bounded wait)."""
        self.stop_accepting()
        with self._lock:
            live = list(self._live)
            self._stop = True
        for rid in live:
            self.batcher.cancel(rid)
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


# ----------------------------------------------------------------------------------- the app

@dataclasses.dataclass
class ServerConfig:
    model_name: str
    capacity: int
    vocab_size: int
    default_stop_ids: tuple
    default_max_tokens: int = 256
    default_tau: float = 0.4
    default_lam: float = 0.02
    api_key: str | None = None
    slots: int = 0
    method: str = ""
    window: int = 0
    max_body_bytes: int = 8 << 20   # larger bodies are refused with 413 before they are read


def build_app(engine: Engine, tokenizer, cfg: ServerConfig):
    """The FastAPI application over a started `Engine`."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse
    from decode.decoder import Request
    from decode.text import split_stop_strings

    app = FastAPI(title="wedlm-serve")
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def check_auth(http: HTTPRequest):
        if cfg.api_key is None:
            return
        got = http.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(http: HTTPRequest) -> dict:
        """The JSON object of the request: refused with 413 past `max_body_bytes` (by its
        Content-Length before reading, else while reading), parsed off the event loop (a large
        body never stalls /health), nesting beyond what the parser takes a 400."""
        limit = cfg.max_body_bytes
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is {int(declared)} bytes, more than the server's "
                                f"limit of {limit} bytes (--max-body-bytes)", type="invalid_request_error",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is more than the server's limit of {limit} "
                                    "bytes (--max-body-bytes)", type="invalid_request_error",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            body = await asyncio.to_thread(json.loads, b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad(None, "the request body is not valid JSON", "invalid_json") from None
        except RecursionError:
            raise bad(None, "the request body's JSON is nested too deeply", "invalid_json") from None
        if not isinstance(body, dict):
            raise bad(None, "the request body must be a JSON object", "invalid_type")
        model = body.get("model")
        if model is None:
            raise bad("model", "'model' is required", "missing_required_parameter")
        if model != cfg.model_name:
            raise bad("model", f"model {model!r} does not exist; this server serves {cfg.model_name!r}",
                      "model_not_found")
        return body

    def make_request(ids: list, s: Settings, param: str):
        """OpenAI's / vLLM's lengths: a prompt that leaves no room, or a named max_tokens that does
        not fit beside it, is a 400 context_length_exceeded; the server's default max_tokens is
        cut to the room left."""
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
            one_token, _ = split_stop_strings(tokenizer, s.stop)
        except DecodeConfigError as e:
            raise bad("stop", str(e)) from None
        stop_ids = tuple(dict.fromkeys(list(cfg.default_stop_ids) + one_token))
        if len(stop_ids) > MAX_STOP_IDS:
            raise bad("stop", f"too many stop sequences: {len(stop_ids)} stop token ids with the "
                              f"defaults, at most {MAX_STOP_IDS}")
        return Request(prompt=tuple(ids), max_new_tokens=s.max_tokens,
                       tau=cfg.default_tau if s.tau is None else s.tau,
                       lam=cfg.default_lam if s.lam is None else s.lam,
                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                       stop_token_ids=stop_ids, seed=s.seed)

    def submit(request, param):
        """-> (request id, asyncio queue of ('tokens', ids) / ('finish', Finished) / ('error', msg))."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)
        try:
            rid = engine.submit(request, on_tokens=lambda _rid, ids: put(("tokens", list(ids))),
                                on_finish=lambda fin: put(("finish", fin)),
                                on_error=lambda msg: put(("error", msg)))
        except Busy:
            raise APIError(429, f"the server is busy ({engine.max_pending} requests in flight); retry",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except DecodeConfigError as e:
            raise bad(_field_of(str(e), param), str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error", code="unavailable",
                           headers={"Retry-After": "5"}) from None
        return rid, q

    def usage(n_prompt, n_out):
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def stats(fin, n_out):
        if fin is None:
            return None
        return {"steps": fin.steps, "n_fwd": fin.n_fwd, "p_cache": n_out / fin.n_fwd if fin.n_fwd else 0.0}

    async def run(http, ids, s: Settings, chat: bool, param: str):
        request = make_request(ids, s, param)
        rid, q = submit(request, param)
        text = TextStream(tokenizer, s.stop)
        head = dict(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                    model=cfg.model_name)
        if s.stream:
            return StreamingResponse(stream(rid, q, text, head, s, chat, len(ids)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        fin, reason = None, None
        try:
            while reason is None:
                try:
                    kind, val = await asyncio.wait_for(q.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        engine.cancel(rid)
                        return JSONResponse({}, status_code=499)
                    continue
                if kind == "tokens":
                    text.add(val)
                    if text.stopped:
                        engine.cancel(rid)
                        reason = "stop"
                elif kind == "finish" and val.finish == "error":
                    raise APIError(500, f"request {rid} failed in the engine ({val.error}); the "
                                   "server goes on", type="server_error", code="request_failed")
                elif kind == "finish":
                    fin = val
                    if not text.stopped and len(text.ids) < len(fin.tokens):  # tokens not yet handed out
                        text.add(fin.tokens[len(text.ids):])
                    text.finish()
                    reason = "stop" if text.stopped else fin.finish
                else:
                    raise APIError(500, val, type="server_error", code="engine_failed")
        except asyncio.CancelledError:
            engine.cancel(rid)
            raise
        n_out = text.n_used
        choice = ({"index": 0, "message": {"role": "assistant", "content": text.sent},
                   "logprobs": None, "finish_reason": reason} if chat else
                  {"index": 0, "text": text.sent, "logprobs": None, "finish_reason": reason})
        return JSONResponse(dict(head, object="chat.completion" if chat else "text_completion",
                                 choices=[choice], usage=usage(len(ids), n_out), wedlm=stats(fin, n_out)))

    async def stream(rid, q, text: TextStream, head, s: Settings, chat: bool, n_prompt: int):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta=None, reason=None, **extra):
            if chat:
                d = {} if delta is None else ({"content": delta} if not isinstance(delta, dict) else delta)
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            return "data: " + json.dumps(dict(head, object=obj, choices=[choice], **extra)) + "\n\n"

        done = False
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            fin, reason = None, None
            while reason is None:
                kind, val = await q.get()
                if kind == "tokens":
                    delta = text.add(val)
                    if delta:
                        yield chunk(delta)
                    if text.stopped:
                        engine.cancel(rid)
                        reason = "stop"
                elif kind == "finish" and val.finish == "error":
                    msg = f"request {rid} failed in the engine ({val.error}); the server goes on"
                    yield "data: " + json.dumps(APIError(500, msg, type="server_error").body()) + "\n\n"
                    reason = "error"
                elif kind == "finish":
                    fin = val
                    if not text.stopped and len(text.ids) < len(fin.tokens):
                        text.add(fin.tokens[len(text.ids):])
                    delta = text.finish()
                    if delta:
                        yield chunk(delta)
                    reason = "stop" if text.stopped else fin.finish
                else:
                    yield "data: " + json.dumps(APIError(500, val, type="server_error").body()) + "\n\n"
                    reason = "error"
            done = True
            if reason != "error":
                yield chunk(None, reason, wedlm=stats(fin, text.n_used))
                if s.include_usage:
                    yield "data: " + json.dumps(dict(head, object=obj, choices=[],
                                                     usage=usage(n_prompt, text.n_used))) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not done:   # the client went away (or the server is stopping): free the slot
                engine.cancel(rid)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        check_auth(http)
        body = await read_body(http)
        s = parse_settings(body, cfg.default_max_tokens)
        ids = await asyncio.to_thread(parse_prompt, body, tokenizer, cfg.vocab_size)   # off the loop
        return await run(http, ids, s, chat=False, param="prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        check_auth(http)
        body = await read_body(http)
        s = parse_settings(body, cfg.default_max_tokens, ("max_tokens", "max_completion_tokens"))
        ids = await asyncio.to_thread(parse_messages, body, tokenizer)                # off the loop
        return await run(http, ids, s, chat=True, param="messages")

    @app.get("/v1/models")
    async def models(http: HTTPRequest):
        check_auth(http)
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": created,
                                             "owned_by": "wedlm-jax", "max_model_len": cfg.capacity}]}

    @app.get("/health")
    async def health():
        b = engine.batcher
        status = "error" if engine.error else "ok" if engine.accepting else "stopping"
        return JSONResponse({"status": status, "error": engine.error, "slots": cfg.slots,
                             "method": cfg.method, "window": cfg.window, "active": b.num_active,
                             "waiting": b.num_waiting, "pending": engine.pending,
                             "max_pending": engine.max_pending, "steps": engine.steps,
                             "finished": dict(engine.finished)},
                            status_code=200 if status == "ok" else 503)

    return app


def _field_of(message: str, default: str) -> str:
    """The request field a DecodeConfigError names (its messages start with the field)."""
    names = {"max_new_tokens": "max_tokens", "tau": "tau", "lam": "lam", "temperature": "temperature",
             "top_k": "top_k", "top_p": "top_p", "seed": "seed", "stop_token_ids": "stop", "prompt": default}
    for word in message.replace("'", " ").split():
        if word in names:
            return names[word]
    return default


# ----------------------------------------------------------------------------------- main

def _parser() -> argparse.ArgumentParser:
    from decode.config import METHODS, DecodeConfig
    d = DecodeConfig()
    p = argparse.ArgumentParser(prog="wedlm-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="Orbax or Hugging Face checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the `model` clients name (default: the folder's name)")
    p.add_argument("--api-key", default=None, help=f"require this bearer token (default: ${API_KEY_ENV})")
    p.add_argument("--slots", type=int, default=16, help="requests decoded at once")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    p.add_argument("--method", default="streaming", help=f"one of {', '.join(METHODS)}")
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--capacity", type=int, default=2048, help="prompt + generated tokens per request")
    p.add_argument("--steps-per-call", type=int, default=8, help="decode steps per device call (a chunk)")
    p.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    p.add_argument("--tau", type=float, default=d.tau, help="default tau of a request")
    p.add_argument("--lam", type=float, default=d.lam, help="default lambda of a request")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--no-default-stops", action="store_true",
                   help="do not stop at eos / <|im_end|> from the tokenizer and generation_config.json")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take before they are cancelled")
    p.add_argument("--lazy-compile", action="store_true",
                   help="compile prompt buckets on first use instead of before serving (faster start)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body accepted (413 beyond it; default 8 MiB)")
    p.add_argument("--log-level", default="info")
    return p


def _check_args(args):
    from decode.config import DecodeConfig
    DecodeConfig(method=args.method, window=args.window, tau=args.tau, lam=args.lam,
                 max_new_tokens=args.max_tokens)
    for name in ("slots", "capacity", "steps_per_call"):
        if getattr(args, name) < 1:
            raise DecodeConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_body_bytes < 1:
        raise DecodeConfigError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.max_queue < 0:
        raise DecodeConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise DecodeConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise DecodeConfigError("--api-key is empty")


def load_decoder(args):
    """(Decoder, tokenizer, ServerConfig) from parsed arguments; reads the checkpoint."""
    from decode.cli import load_model
    from decode.decoder import Decoder
    from decode.text import load_tokenizer
    from wedlm_jax.convert import read_config

    from decode.cli import _mask_token_id
    model_config = read_config(args.checkpoint)
    args.mask_token_id = _mask_token_id(args, model_config)   # released checkpoints: null mask id
    tokenizer = load_tokenizer(args.checkpoint)
    stops = () if args.no_default_stops else tuple(tokenizer.default_stop_ids(model_config.eos_token_id))
    if len(stops) > MAX_STOP_IDS:
        raise DecodeConfigError(f"the checkpoint's default stops are {len(stops)} ids, more than {MAX_STOP_IDS}")
    config, params = load_model(args.checkpoint)
    decoder = Decoder(params, config, method=args.method, window=args.window, slots=args.slots,
                      capacity=args.capacity, steps_per_call=args.steps_per_call,
                      mask_token_id=args.mask_token_id)
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    cfg = ServerConfig(model_name=name, capacity=decoder.capacity, vocab_size=config.vocab_size,
                       default_stop_ids=stops, default_max_tokens=args.max_tokens, default_tau=args.tau,
                       default_lam=args.lam, api_key=args.api_key, slots=args.slots, method=args.method,
                       window=args.window, max_body_bytes=args.max_body_bytes)
    return decoder, tokenizer, cfg


def warm_up(batcher, capacity: int, every_bucket: bool = True) -> float:
    """Compile before serving: one short request per prompt bucket (the Decoder compiles prefill and
    insert once per power-of-two prompt bucket, generate once), so no client waits on a compile.
    every_bucket=False compiles the smallest bucket only (the others compile on first use)."""
    from decode.decoder import Request
    lengths, n = [1], 16
    while every_bucket and n <= 2 * capacity:
        lengths.append(min(n, capacity))
        n *= 2
    t0 = time.perf_counter()
    for length in dict.fromkeys(lengths):
        batcher.submit(Request(prompt=(0,) * length, max_new_tokens=1))
    batcher.run_until_idle()
    return time.perf_counter() - t0


def build_server(args):
    """(engine, app, ServerConfig): load, compile, start the engine thread."""
    from decode.batching import Batcher
    decoder, tokenizer, cfg = load_decoder(args)
    batcher = Batcher(decoder)
    log.info("compiled in %.1f s", warm_up(batcher, cfg.capacity, every_bucket=not args.lazy_compile))
    engine = Engine(batcher, max_pending=args.slots + args.max_queue).start()
    return engine, build_app(engine, tokenizer, cfg), cfg


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        _check_args(args)
        import fastapi  # noqa: F401  (the optional `serve` extra)
        import uvicorn
    except DecodeConfigError as e:
        print(f"wedlm-serve: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"wedlm-serve: error: {e.name} is missing; install the serve extra: pip install "
              f"'wedlm-jax[serve]'", file=sys.stderr)
        return 2
    try:
        engine, app, cfg = build_server(args)
    except (DecodeConfigError, ValueError, FileNotFoundError) as e:
        print(f"wedlm-serve: error: {e}", file=sys.stderr)
        return 2

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):   # SIGTERM / SIGINT: refuse new work at once
            engine.stop_accepting()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.shutdown_timeout))
    log.info("serving %r (%s, W=%d, %d slots, capacity %d) on http://%s:%d%s", cfg.model_name, args.method,
             args.window, args.slots, cfg.capacity, args.host, args.port,
             " (API key required)" if args.api_key else "")
    # uvicorn re-raises the signal that stopped it once it is done; by then the shutdown was
    # graceful, so that second delivery is swallowed here and the process exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.shutdown(timeout=args.shutdown_timeout)
    return 0 if engine.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
