"""wedlm-serve: an OpenAI-compatible HTTP server over the continuous batcher.

    wedlm-serve --checkpoint DIR [--host 127.0.0.1 --port 8000 --slots 16 --method streaming
                                  --window 16 --api-key KEY]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template),
GET /v1/models, GET /health, GET /metrics (Prometheus: decode/metrics.py), and the
tokenizer's: GET /tokenizer_info, POST /tokenize, POST /detokenize (vLLM's shapes; lm-eval's
`tokenizer_backend=remote` uses them). Scoring: completions
take `echo` and `logprobs` (0-20), chat `logprobs: true` and `top_logprobs`; the log-probabilities
are the AR reading's (decode/serving/scoring.py), computed on the engine thread, batched across requests. `stream: true` answers with server-sent events in the OpenAI chunk
format ending with `data: [DONE]` (`stream_options: {"include_usage": true}` adds the usage chunk);
other answers carry `usage`. Request settings: max_tokens (chat: or max_completion_tokens),
stop (a string or up to MAX_STOP_STRINGS strings), `n` (up to the slots, each choice its own
request with the seed + its index; not with `stream`) and every Sampling option a request sets
by name (protocol.WIRE: temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
repetition_penalty, logit_bias, seed, sampling_order and WeDLM's `tau` and `lam`), applied on the
device inside the decode loop; method, window, slots and capacity are the server's. Answers also
carry a `wedlm` object (steps, n_fwd, p_cache).

Layout: `decode/serving/protocol.py` parses request bodies and words the errors (no device work),
`decode/serving/worker.py` is the thread that owns the device, `decode/serving/app.py` the HTTP handlers, this
file the command (options, checks, loading, warm-up, signals).

Design: ONE engine thread owns the device and calls `Batcher.step()` (one jitted chunk of steps);
the HTTP handlers (uvicorn's event loop) only submit, cancel and read the tokens the engine thread
hands over through `loop.call_soon_threadsafe`. At most slots + --max-queue requests are admitted
(beyond: 429 with Retry-After). A client that disconnects is cancelled (its slot is freed at the
next step boundary). Stop strings are matched on the host: the text is cut before the string, the
request cancelled; single-token stop strings also stop the slot on the device. A bad request gets
400 with an OpenAI error body naming the field before anything reaches the engine. With --api-key
(or WEDLM_API_KEY) every /v1 request needs `Authorization: Bearer KEY` (401 otherwise); /health
stays open for probes (and /metrics with --metrics-public). One INFO line per finished request
(token counts and timings; the prompt's text only with --log-prompts). SIGTERM: stop accepting,
let in-flight requests finish (cancel what is left after --shutdown-timeout seconds), stop the
engine, exit 0.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects

import argparse
import logging
import os
import signal
import sys
import threading

from decode.serving.app import ServerConfig, build_app  # noqa: F401 (the app; re-exported)
from decode.options import HelpFormatter
from decode.config import (MAX_LOGPROBS, MAX_STOP_IDS, DecodeConfigError, DoorOptions, Placement,
                           add_decoding_arguments, check_int)
from decode.serving.worker import Busy, EngineThread  # noqa: F401 (the engine thread; re-exported)
from decode.serving.protocol import (APIError, parse_messages, parse_prompt,  # noqa: F401 (re-exported)
                             parse_settings)
from decode.text import TextStream  # noqa: F401 (the one stop handler; re-exported)
from wedlm_jax import compile_cache

API_KEY_ENV = "WEDLM_API_KEY"
log = logging.getLogger("wedlm-serve")


# ----------------------------------------------------------------------------------- main

EPILOG = """structured output (the openai client; also on /v1/completions through extra_body):
  client.chat.completions.create(model="m", messages=[...], response_format={"type":
      "json_schema", "json_schema": {"name": "row", "schema": {"type": "object", ...}}})
  vLLM's fields too: "structured_outputs": {"json" | "regex" | "choice": ...}, guided_json,
  guided_regex, guided_choice; a bad schema or regex is a 400 naming the field.
metrics: GET /metrics (Prometheus; behind --api-key unless --metrics-public)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wedlm-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter, epilog=EPILOG)
    p.add_argument("--checkpoint", required=True, help="Orbax or Hugging Face checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
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
    p.add_argument("--log-prompts", action="store_true",
                   help="put each prompt's text in its finished-request log line (default: counts only)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve GET /metrics without the API key (for a scraper inside the network)")
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


def _check_args(args) -> DoorOptions:
    """The options every door shares (returned, checked once) and the server's own."""
    opts = DoorOptions.from_args(args)
    if args.max_body_bytes < 1:
        raise DecodeConfigError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    check_int("--max-logprobs", args.max_logprobs, 0, MAX_LOGPROBS)
    if args.max_queue < 0:
        raise DecodeConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise DecodeConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise DecodeConfigError("--api-key is empty")
    return opts


def api_key(args) -> str | None:
    """--api-key, else $WEDLM_API_KEY (API_KEY_ENV), else none."""
    return args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def load_decoder(args, opts: DoorOptions | None = None):
    """(Decoder, tokenizer, ServerConfig) from parsed arguments (and their options, when checked
    already); reads the checkpoint."""
    from decode.checkpoint import OpenCheckpoint
    from decode.engine.decoder import Decoder
    from decode.engine.plan import door_plan
    from wedlm_jax.model import layers_stacked

    opts = opts or DoorOptions.from_args(args)
    placement = opts.placement
    ckpt = OpenCheckpoint.from_args(args, placement, prog="wedlm-serve")
    tokenizer, stops = ckpt.tokenizer, ckpt.default_stop_ids
    if len(stops) > MAX_STOP_IDS:
        raise DecodeConfigError(f"the checkpoint's default stops are {len(stops)} ids, more than {MAX_STOP_IDS}")
    config, params, mesh = ckpt.load()
    decoder = Decoder(params, door_plan(opts, config, capacity=args.capacity, mesh=mesh,
                                        mask_token_id=ckpt.mask_token_id,
                                        top_logprobs=args.max_logprobs,
                                        stacked_params=layers_stacked(params)))
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    cfg = ServerConfig(model_name=name, capacity=decoder.capacity, vocab_size=config.vocab_size,
                       default_stop_ids=stops, defaults=opts.sampling, api_key=api_key(args),
                       slots=args.slots, method=args.method, window=args.window,
                       max_body_bytes=args.max_body_bytes, max_logprobs=args.max_logprobs,
                       metrics_public=args.metrics_public)
    return decoder, tokenizer, cfg


def scorer_for(decoder):
    """The engine's scorer: the AR reading of the Decoder's own weights (decode.serving.scoring)."""
    from decode.serving.scoring import score
    return lambda sequences, top_n: score(decoder.params, decoder.model_config, sequences, top_n,
                                          decoder.static.dtype)


def build_server(args, opts: DoorOptions | None = None):
    """(engine, app, ServerConfig): load, compile, start the engine thread."""
    from decode.engine.batcher import Batcher
    from decode.metrics import ServerMetrics
    decoder, tokenizer, cfg = load_decoder(args, opts)
    batcher = Batcher(decoder)
    log.info("compiled in %.1f s", batcher.warm_up(cfg.capacity, every_bucket=not args.lazy_compile))
    metrics = ServerMetrics(batcher, cfg.model_name, args.method, log_prompts=args.log_prompts,
                            tokenizer=tokenizer)
    engine = EngineThread(batcher, max_pending=args.slots + args.max_queue,
                          scorer=scorer_for(decoder), metrics=metrics).start()
    return engine, build_app(engine, tokenizer, cfg), cfg


def main(argv=None) -> int:
    from wedlm_jax import platforms
    platforms.choose()      # no backend whose hardware is absent (a libtpu lock, a CUDA error)
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        opts = _check_args(args)
        if args.dry_run:
            from decode.compile.aot import dry_run_door
            return dry_run_door(args, "wedlm-serve")
        import fastapi  # noqa: F401  (the optional `serve` extra)
        import prometheus_client  # noqa: F401  (the serve extra: GET /metrics)
        import uvicorn
        check_port(args.host, args.port)
        compile_cache.enable(args.compile_cache)
    except (DecodeConfigError, ValueError) as e:
        print(f"wedlm-serve: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"wedlm-serve: error: {e.name} is missing; install the serve extra: pip install -e "
              f"'.[serve]' in the repository", file=sys.stderr)
        return 2
    try:
        engine, app, cfg = build_server(args, opts)
    except (DecodeConfigError, ValueError, FileNotFoundError) as e:
        print(f"wedlm-serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nwedlm-serve: interrupted (Ctrl-C) while loading or compiling; not serving",
              file=sys.stderr)
        return 130

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
             " (API key required)" if cfg.api_key else "")
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
