"""The OpenAI-compatible application of wedlm-serve (`build_app`): the HTTP routes over a started
`decode.serving.worker.EngineThread`, their key check and body limits, and the small endpoints
(models, the tokenizer's, health). The completion endpoints are `decode/serving/completions.py`, the
protocol (parsing, errors) `decode/serving/protocol.py`, the metrics (GET /metrics)
`decode/metrics.py`, the command that builds the engine and serves this app
`decode/serving/serve.py` (its docstring has the design).

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
from typing import Any

from decode.config import Sampling
from decode.serving.worker import EngineThread
from decode.serving.lora_routes import model_of
from decode.serving.protocol import APIError, bad, parse_detokenize, parse_tokenize

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
    metrics_public: bool = False    # GET /metrics without the key (--metrics-public)
    constraint_backend: str = "auto"  # structured outputs: auto, device or host (--constraint-backend)
    tool_parser: str | None = None    # the tool-call format (--tool-call-parser), None: no tools
    auto_tool_choice: bool = False    # tool_choice 'auto' allowed (--enable-auto-tool-choice)
    adapters: Any = None              # decode.engine.runtime.adapters.Adapters (--enable-lora), or None


def check_auth(http, cfg: ServerConfig) -> None:
    """A 401 unless the request carries the server's key (when it has one)."""
    if cfg.api_key is None:
        return
    got = http.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
        raise APIError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                       type="authentication_error", code="invalid_api_key")


async def read_body(http, cfg: ServerConfig, need_model: bool = True) -> dict:
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
        model_of(body, cfg)     # a loaded LoRA adapter, else a 404 model_not_found (OpenAI's, vLLM's)
    return body


def describe_tokenizer(tokenizer, cfg: ServerConfig) -> dict:
    """/tokenizer_info's answer, as vLLM gives it."""
    sp = tokenizer.special
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.capacity,
            "vocab_size": cfg.vocab_size, "eos_token": sp.get("eos_token"),
            "bos_token": sp.get("bos_token"), "pad_token": sp.get("pad_token"),
            "unk_token": sp.get("unk_token"), "chat_template": tokenizer.chat_template}


def health_report(engine: EngineThread, cfg: ServerConfig) -> tuple[dict, int]:
    """(body, status): 200 while the engine serves, else 503 ('stopping' or 'error')."""
    b = engine.batcher
    status = "error" if engine.error else "ok" if engine.accepting else "stopping"
    return ({"status": status, "error": engine.error, "slots": cfg.slots,
             "method": cfg.method, "window": cfg.window, "active": b.num_active,
             "waiting": b.num_waiting, "pending": engine.pending,
             "max_pending": engine.max_pending, "steps": engine.steps,
             "finished": dict(engine.finished)}, 200 if status == "ok" else 503)


def build_app(engine: EngineThread, tokenizer, cfg: ServerConfig):
    """The FastAPI application over a started `EngineThread`: its routes, each but /health checking
    the key first (/metrics too unless `cfg.metrics_public`; served when the engine has metrics)
    (the completion endpoints' work: `decode.serving.completions.Completions`)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, PlainTextResponse
    from decode.serving.completions import Completions
    from decode.serving.lora_routes import load_adapter, model_cards, unload_adapter

    app = FastAPI(title="wedlm-serve")
    created = int(time.time())
    completion = Completions(engine, tokenizer, cfg)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        check_auth(http, cfg)
        return await completion.completions(http, await read_body(http, cfg))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        check_auth(http, cfg)
        return await completion.chat_completions(http, await read_body(http, cfg))

    # the tokenizer endpoints vLLM serves and lm-eval's remote tokenizer probes (no `model` needed)
    @app.get("/tokenizer_info")
    async def tokenizer_info(http: HTTPRequest):
        check_auth(http, cfg)
        return describe_tokenizer(tokenizer, cfg)

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        check_auth(http, cfg)
        body = await read_body(http, cfg, need_model=False)
        ids = await asyncio.to_thread(parse_tokenize, body, tokenizer)               # off the loop
        return {"count": len(ids), "max_model_len": cfg.capacity, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        check_auth(http, cfg)
        body = await read_body(http, cfg, need_model=False)
        ids = parse_detokenize(body, cfg.vocab_size)
        return {"prompt": await asyncio.to_thread(tokenizer.decode, ids)}

    @app.get("/v1/models")
    async def models(http: HTTPRequest):
        check_auth(http, cfg)
        return {"object": "list", "data": model_cards(cfg, created)}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(http: HTTPRequest):
        check_auth(http, cfg)
        body = await read_body(http, cfg, need_model=False)
        return PlainTextResponse(await load_adapter(engine, cfg, body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(http: HTTPRequest):
        check_auth(http, cfg)
        body = await read_body(http, cfg, need_model=False)
        return PlainTextResponse(await unload_adapter(engine, cfg, body))

    if engine.metrics is not None:
        from fastapi.responses import Response
        from decode.metrics import CONTENT_TYPE

        @app.get("/metrics")
        async def metrics(http: HTTPRequest):
            if not cfg.metrics_public:
                check_auth(http, cfg)
            body = await asyncio.to_thread(engine.metrics.exposition)   # off the loop
            return Response(body, headers={"Content-Type": CONTENT_TYPE})

    @app.get("/health")
    async def health():
        body, status = health_report(engine, cfg)
        return JSONResponse(body, status_code=status)

    return app
