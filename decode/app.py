"""The OpenAI-compatible application of wedlm-serve (`build_app`): the HTTP handlers over a started
`decode.engine.Engine`. The protocol (parsing, errors) is `decode/protocol.py`, the command that
builds the engine and serves this app is `decode/serve.py` (its docstring has the design).

The handlers run on uvicorn's event loop and never touch the device: they parse (tokenizing off
the loop), submit to the engine thread, and read the tokens it hands over.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid

from decode.config import MAX_LOGPROBS, MAX_STOP_IDS, DecodeConfigError, Sampling
from decode.engine import Busy, Engine
from decode.protocol import (MAX_BATCH, APIError, Settings, _field_of, bad, chat_logprobs_object,
                             generated_scores, logprobs_object, parse_detokenize, parse_messages,
                             parse_prompts, parse_settings, parse_tokenize)
from decode.text import TextStream, split_stop_strings

log = logging.getLogger("wedlm-serve")


@dataclasses.dataclass
class ServerConfig:
    model_name: str
    capacity: int
    vocab_size: int
    default_stop_ids: tuple
    defaults: Sampling = Sampling()  # every request's, before its body's values (the command line)
    api_key: str | None = None
    slots: int = 0
    method: str = ""
    window: int = 0
    max_body_bytes: int = 8 << 20   # larger bodies are refused with 413 before they are read
    max_logprobs: int = 5           # alternatives a generated token carries (the Decoder's top_logprobs)


def build_app(engine: Engine, tokenizer, cfg: ServerConfig):
    """The FastAPI application over a started `Engine`."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse
    from decode.decoder import Request

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

    async def read_body(http: HTTPRequest, need_model: bool = True) -> dict:
        """The JSON object of the request: refused with 413 past `max_body_bytes` (by its
        Content-Length before reading, else while reading), parsed off the event loop (a large
        body never stalls /health), nesting beyond what the parser takes a 400. `model` is
        required when `need_model` (the /v1 endpoints), else checked only when given."""
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
        if model is None and need_model:
            raise bad("model", "'model' is required", "missing_required_parameter")
        if model is not None and model != cfg.model_name:
            raise bad("model", f"model {model!r} does not exist; this server serves {cfg.model_name!r}",
                      "model_not_found")
        return body

    def make_request(ids: list, s: Settings, param: str):
        """OpenAI's / vLLM's lengths: a prompt that leaves no room, or a named max_tokens that does
        not fit beside it, is a 400 context_length_exceeded; the server's default max_tokens is
        cut to the room left."""
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
            one_token, _ = split_stop_strings(tokenizer, s.stop)
        except DecodeConfigError as e:
            raise bad("stop", str(e)) from None
        stop_ids = tuple(dict.fromkeys(list(cfg.default_stop_ids) + one_token))
        if len(stop_ids) > MAX_STOP_IDS:
            raise bad("stop", f"too many stop sequences: {len(stop_ids)} stop token ids with the "
                              f"defaults, at most {MAX_STOP_IDS}")
        try:
            return Request(prompt=tuple(ids), **Sampling.pick(s.sampling.replace(
                max_new_tokens=s.max_tokens, stop_token_ids=stop_ids)), top_logprobs=s.logprobs or 0)
        except DecodeConfigError as e:
            raise bad(_field_of(e, param), str(e)) from None

    def submit(request, param):
        """-> (request id, asyncio queue of ('tokens', ids) / ('finish', Finished) / ('error', msg))."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        put = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)
        try:
            rid = engine.submit(request, on_tokens=lambda _rid, ids: put(("tokens", list(ids))),
                                on_finish=lambda fin: put(("finish", fin)),
                                on_error=lambda msg, status=500: put(("error", (status, msg))))
        except Busy:
            raise APIError(429, f"the server is busy ({engine.max_pending} requests in flight); retry",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except DecodeConfigError as e:
            raise bad(_field_of(e, param), str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error", code="unavailable",
                           headers={"Retry-After": "5"}) from None
        return rid, q

    def usage(n_prompt, n_out, fin=None):
        out = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        if fin is not None and fin.cached_tokens:   # prefix reuse (--page-size)
            out["prompt_tokens_details"] = {"cached_tokens": fin.cached_tokens}
        return out

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
        text, reason, fin = await collect(http, rid, q, text, want_finish=s.logprobs is not None)
        if reason is None:
            return JSONResponse({}, status_code=499)
        n_out = text.n_used
        choice = ({"index": 0, "message": {"role": "assistant", "content": text.sent},
                   "logprobs": None, "finish_reason": reason} if chat else
                  {"index": 0, "text": text.sent, "logprobs": None, "finish_reason": reason})
        if chat and s.logprobs is not None:
            seq = list(ids) + list(text.ids[:n_out])
            scored = await sequence_scores(ids, fin, n_out, s.logprobs, echo=False)
            choice["logprobs"] = await asyncio.to_thread(chat_logprobs_object, tokenizer, seq, scored,
                                                          len(ids), s.logprobs)
        return JSONResponse(dict(head, object="chat.completion" if chat else "text_completion",
                                 choices=[choice], usage=usage(len(ids), n_out, fin),
                                 wedlm=stats(fin, n_out)))

    async def collect(http, rid, q, text: TextStream, want_finish: bool = False):
        """A request's tokens until it finishes: (text, finish reason, Finished); the reason is
        None when the client went away (the request is cancelled). A stop string cancels the
        request; with `want_finish` its Finished (the generated tokens' log-probabilities) is
        awaited all the same."""
        fin, reason = None, None
        try:
            while reason is None:
                try:
                    kind, val = await asyncio.wait_for(q.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        engine.cancel(rid)
                        return text, None, None
                    continue
                if kind == "tokens":
                    text.add(val)
                    if text.stopped:
                        engine.cancel(rid)
                        reason = None if want_finish else "stop"
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
                    status, msg = val
                    raise APIError(status, msg, type="server_error",
                                   code="engine_failed" if status == 500 else "unavailable")
        except asyncio.CancelledError:
            engine.cancel(rid)
            raise
        return text, reason, fin

    async def engine_score(sequences, top_n: int) -> list:
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
            engine.score(sequences, top_n, lambda r: loop.call_soon_threadsafe(settle, r))
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error", code="unavailable",
                           headers={"Retry-After": "5"}) from None
        try:
            return await fut
        except DecodeConfigError as e:
            raise bad("prompt", str(e)) from None

    async def sequence_scores(ids, fin, n_out: int, top_n: int, echo: bool) -> dict:
        """`scored` (decode.scoring's shape) for prompt + the first n_out generated tokens: the
        prompt's by the AR reading on the engine thread when `echo` (else None entries), the
        generated tokens' as the decoding carried them (docs/algorithm.md §6)."""
        prompt = ((await engine_score([list(ids)], top_n))[0] if echo else
                  {"token_logprobs": [None] * len(ids), "top_logprobs": [None] * len(ids)})
        gen = generated_scores(fin.logprobs if fin is not None else [], n_out, top_n)
        return {k: list(prompt[k]) + gen[k] for k in ("token_logprobs", "top_logprobs")}

    async def scored_choices(http, prompts: list, s: Settings):
        """/v1/completions with `echo`, `logprobs` or several prompts: one choice per prompt (each
        generated as its own request through the engine; the prompt scored by the AR reading
        when echoed, the completion's log-probabilities as its decoding carried them)."""
        async def one(i, ids):
            out, sent, reason, fin = [], "", "length", None
            if s.max_tokens > 0:
                rid, q = submit(make_request(ids, s, "prompt"), "prompt")
                text, reason, fin = await collect(http, rid, q, TextStream(tokenizer, s.stop),
                                                  want_finish=s.logprobs is not None)
                if reason is None:
                    return None
                out, sent = text.ids[:text.n_used], text.sent
            choice = {"index": i, "text": (tokenizer.decode(ids) if s.echo else "") + sent,
                      "logprobs": None, "finish_reason": reason}
            if s.logprobs is not None:
                seq = list(ids) + list(out)
                scored = await sequence_scores(ids, fin, len(out), s.logprobs, s.echo)
                choice["logprobs"] = await asyncio.to_thread(logprobs_object, tokenizer, seq, scored,
                                                             0 if s.echo else len(ids), s.logprobs)
            return choice, len(ids), len(out), fin

        results = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        if any(r is None for r in results):
            return JSONResponse({}, status_code=499)
        n_prompt, n_out = sum(r[1] for r in results), sum(r[2] for r in results)
        head = dict(id="cmpl-" + uuid.uuid4().hex, created=int(time.time()), model=cfg.model_name)
        return JSONResponse(dict(head, object="text_completion", choices=[r[0] for r in results],
                                 usage=usage(n_prompt, n_out)))

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
                    status, msg = val
                    err = APIError(status, msg, type="server_error",
                                   code="engine_failed" if status == 500 else "unavailable")
                    yield "data: " + json.dumps(err.body()) + "\n\n"
                    reason = "error"
            done = True
            if reason != "error":
                yield chunk(None, reason, wedlm=stats(fin, text.n_used))
                if s.include_usage:
                    yield "data: " + json.dumps(dict(head, object=obj, choices=[],
                                                     usage=usage(n_prompt, text.n_used, fin))) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not done:   # the client went away (or the server is stopping): free the slot
                engine.cancel(rid)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        check_auth(http)
        body = await read_body(http)
        s = parse_settings(body, cfg.defaults, scoring=True)
        prompts = await asyncio.to_thread(parse_prompts, body, tokenizer, cfg.vocab_size,
                                          MAX_BATCH, cfg.capacity)                    # off the loop
        if len(prompts) == 1 and s.logprobs is None and not s.echo:
            return await run(http, prompts[0], s, chat=False, param="prompt")
        if s.stream:
            raise bad("stream", "'stream': true takes one prompt without 'logprobs' or 'echo'",
                      "unsupported_value")
        return await scored_choices(http, prompts, s)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        check_auth(http)
        body = await read_body(http)
        s = parse_settings(body, cfg.defaults, ("max_tokens", "max_completion_tokens"),
                           chat=True)
        ids = await asyncio.to_thread(parse_messages, body, tokenizer, True, False,
                                      cfg.capacity)                                   # off the loop
        return await run(http, ids, s, chat=True, param="messages")

    # the tokenizer endpoints vLLM serves and lm-eval's remote tokenizer probes (no `model` needed)
    @app.get("/tokenizer_info")
    async def tokenizer_info(http: HTTPRequest):
        check_auth(http)
        sp = tokenizer.special
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.capacity,
                "vocab_size": cfg.vocab_size, "eos_token": sp.get("eos_token"),
                "bos_token": sp.get("bos_token"), "pad_token": sp.get("pad_token"),
                "unk_token": sp.get("unk_token"), "chat_template": tokenizer.chat_template}

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        check_auth(http)
        body = await read_body(http, need_model=False)
        ids = await asyncio.to_thread(parse_tokenize, body, tokenizer)               # off the loop
        return {"count": len(ids), "max_model_len": cfg.capacity, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        check_auth(http)
        body = await read_body(http, need_model=False)
        ids = parse_detokenize(body, cfg.vocab_size)
        return {"prompt": await asyncio.to_thread(tokenizer.decode, ids)}

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
