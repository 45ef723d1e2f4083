"""wedlm-serve: an OpenAI-compatible HTTP server over the continuous batcher (issue 13 item 5).

    wedlm-serve --checkpoint DIR [--host 127.0.0.1 --port 8000 --slots 16 --method streaming
                                  --window 16 --api-key KEY]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template),
GET /v1/models, GET /health, and the tokenizer's: GET /tokenizer_info, POST /tokenize, POST
/detokenize (vLLM's shapes; lm-eval's `tokenizer_backend=remote` uses them). Scoring: completions
take `echo` and `logprobs` (0-20), chat `logprobs: true` and `top_logprobs`; the log-probabilities
are the AR reading's (decode/scoring.py), computed on the engine thread, batched across requests. `stream: true` answers with server-sent events in the OpenAI chunk
format ending with `data: [DONE]` (`stream_options: {"include_usage": true}` adds the usage chunk);
other answers carry `usage`. Request settings: max_tokens (chat: or max_completion_tokens),
temperature, top_p, top_k, seed, stop (a string or up to MAX_STOP_STRINGS strings) and WeDLM's
`tau` and `lam`; method, window, slots and capacity are the server's. Answers also carry a `wedlm`
object (steps, n_fwd, p_cache).

Layout: `decode/protocol.py` parses request bodies and words the errors (no device work),
`decode/engine.py` is the thread that owns the device, this file is the app and the command.

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
import signal
import sys
import threading
import time
import uuid

from decode.config import (MAX_LOGPROBS, MAX_STOP_IDS, DecodeConfigError, Placement,
                           add_decoding_arguments, check_int, decoder_kwargs, decoding_args_config)
from decode.engine import Busy, Engine  # noqa: F401 (the engine thread; re-exported)
from decode.protocol import (MAX_BATCH, MAX_STOP_STRINGS, APIError, Settings,  # noqa: F401
                             _field_of, bad, chat_logprobs_object, generated_scores,
                             logprobs_object,
                             parse_detokenize, parse_messages, parse_prompt,
                             parse_prompts, parse_settings, parse_tokenize)
from decode.text import TextStream, split_stop_strings  # noqa: F401 (the one stop handler)
from wedlm_jax import compile_cache

API_KEY_ENV = "WEDLM_API_KEY"
log = logging.getLogger("wedlm-serve")


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
    default_sampling_order: str = "filter_first"
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
        return Request(prompt=tuple(ids), max_new_tokens=s.max_tokens,
                       tau=cfg.default_tau if s.tau is None else s.tau,
                       lam=cfg.default_lam if s.lam is None else s.lam,
                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                       stop_token_ids=stop_ids, seed=s.seed,
                       sampling_order=s.sampling_order or cfg.default_sampling_order,
                       top_logprobs=s.logprobs or 0)

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
            raise bad(_field_of(str(e), param), str(e)) from None
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
        s = parse_settings(body, cfg.default_max_tokens, scoring=True)
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
        s = parse_settings(body, cfg.default_max_tokens, ("max_tokens", "max_completion_tokens"),
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


# ----------------------------------------------------------------------------------- main

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wedlm-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="Orbax or Hugging Face checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the `model` clients name (default: the folder's name)")
    p.add_argument("--api-key", default=None, help=f"require this bearer token (default: ${API_KEY_ENV})")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    p.add_argument("--max-logprobs", type=int, default=5,
                   help=f"alternatives each generated token carries for `logprobs` / `top_logprobs` "
                        f"(0-{MAX_LOGPROBS}; a compile-time width; prompt scoring takes up to "
                        f"{MAX_LOGPROBS} regardless)")
    add_decoding_arguments(p, "wedlm-serve")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take before they are cancelled")
    p.add_argument("--lazy-compile", action="store_true",
                   help="compile prompt buckets on first use instead of before serving (faster start)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body accepted (413 beyond it; default 8 MiB)")
    p.add_argument("--log-level", default="info")
    Placement.add_arguments(p)
    compile_cache.add_arguments(p)
    Placement.add_dry_run_arguments(p, "the server")
    return p


def check_port(host: str, port: int) -> None:
    """DecodeConfigError when `host:port` cannot be bound (in use, or not this machine's), before
    the model loads and the programs compile."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise DecodeConfigError(f"--host {host} --port {port}: cannot listen there "
                                    f"({e.strerror}); is another server running on it?") from None


def _check_args(args):
    decoding_args_config(args)       # the options every door shares, checked once
    if args.max_body_bytes < 1:
        raise DecodeConfigError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    check_int("--max-logprobs", args.max_logprobs, 0, MAX_LOGPROBS)
    if args.max_queue < 0:
        raise DecodeConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise DecodeConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise DecodeConfigError("--api-key is empty")


def load_decoder(args):
    """(Decoder, tokenizer, ServerConfig) from parsed arguments; reads the checkpoint."""
    from decode.checkpoint import OpenCheckpoint
    from decode.decoder import Decoder

    placement = Placement.from_args(args)
    ckpt = OpenCheckpoint.open(args.checkpoint, placement, method=args.method,
                               mask_token_id=args.mask_token_id,
                               default_stops=not args.no_default_stops, prog="wedlm-serve")
    tokenizer, stops = ckpt.tokenizer, ckpt.default_stop_ids
    args.mask_token_id = ckpt.mask_token_id       # null in config.json: released / tokenizer
    if len(stops) > MAX_STOP_IDS:
        raise DecodeConfigError(f"the checkpoint's default stops are {len(stops)} ids, more than {MAX_STOP_IDS}")
    config, params, mesh = ckpt.load()
    decoder = Decoder(params, config, mesh=mesh, top_logprobs=args.max_logprobs,
                      **decoder_kwargs(args, placement, args.capacity))
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    cfg = ServerConfig(model_name=name, capacity=decoder.capacity, vocab_size=config.vocab_size,
                       default_stop_ids=stops, default_max_tokens=args.max_new_tokens, default_tau=args.tau,
                       default_lam=args.lam, api_key=args.api_key, slots=args.slots, method=args.method,
                       window=args.window, max_body_bytes=args.max_body_bytes,
                       default_sampling_order=args.sampling_order, max_logprobs=args.max_logprobs)
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


def scorer_for(decoder):
    """The engine's scorer: the AR reading of the Decoder's own weights (decode.scoring)."""
    from decode.scoring import score
    return lambda sequences, top_n: score(decoder.params, decoder.model_config, sequences, top_n,
                                          decoder.static.dtype)


def build_server(args):
    """(engine, app, ServerConfig): load, compile, start the engine thread."""
    from decode.batching import Batcher
    decoder, tokenizer, cfg = load_decoder(args)
    batcher = Batcher(decoder)
    log.info("compiled in %.1f s", warm_up(batcher, cfg.capacity, every_bucket=not args.lazy_compile))
    engine = Engine(batcher, max_pending=args.slots + args.max_queue,
                    scorer=scorer_for(decoder)).start()
    return engine, build_app(engine, tokenizer, cfg), cfg


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        _check_args(args)
        if args.dry_run:
            from decode.aot import dry_run_door
            return dry_run_door(args, "wedlm-serve")
        import fastapi  # noqa: F401  (the optional `serve` extra)
        import uvicorn
        check_port(args.host, args.port)
        compile_cache.enable(args.compile_cache)
    except (DecodeConfigError, ValueError) as e:
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
            if engine.accepting:
                engine.stop_accepting()
                # what is still running shortly before uvicorn's own deadline is answered (a
                # stream gets an error event and [DONE]) instead of cut
                grace = max(args.shutdown_timeout - 1.0, 0.5 * args.shutdown_timeout)
                timer = threading.Timer(grace, lambda: log.warning(
                    "shutdown: %d request(s) still running after %.1f s were answered 503",
                    engine.drain(f"the server is shutting down; the request was stopped after "
                                 f"--shutdown-timeout {args.shutdown_timeout:g} s"), grace))
                timer.daemon = True
                timer.start()
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
