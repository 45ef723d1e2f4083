"""wedlm-serve: an OpenAI-compatible HTTP server over the continuous batcher.

    wedlm-serve --checkpoint DIR [--host 127.0.0.1 --port 8000 --slots 16 --method streaming
                                  --window 16 --api-key KEY]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template),
GET /v1/models, GET /health, GET /metrics (Prometheus: decode/metrics.py), with --enable-lora
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (decode/serving/lora_routes.py), and the
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
carry a `wedlm` object (steps: forwards, token_slots, p_cache).

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
import time

from wedlm_jax.runtime import interrupts
interrupts.early("wedlm-serve", __name__)   # Ctrl-C during the imports below: one line, 130

from decode.serving.app import ServerConfig, build_app  # noqa: E402,F401 (the app; re-exported)
from decode.options import HelpFormatter  # noqa: E402
from decode.config import (MAX_LOGPROBS, MAX_STOP_IDS, DecodeConfigError, DoorOptions,  # noqa: E402
                           Placement, add_decoding_arguments, check_int)
from decode.lora_options import LoraOptions  # noqa: E402
from decode.serving.startup import Startup  # noqa: E402
from decode.serving.worker import Busy, EngineThread  # noqa: E402,F401 (the engine thread; re-exported)
from decode.serving.protocol import (APIError, parse_messages, parse_prompt,  # noqa: E402,F401
                                     parse_settings)
from decode.text import TextStream  # noqa: E402,F401 (the one stop handler; re-exported)
from decode.tools.formats import FORMATS  # noqa: E402
from decode.tools.request import renders_tools  # noqa: E402
from wedlm_jax.runtime import compile_cache  # noqa: E402

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
    p.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                   help="read tool calls (`tools`) in this format (hermes: Qwen, WeDLM-8B-Instruct)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (free text, then calls under their schemas)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve GET /metrics without the API key (for a scraper inside the network)")
    LoraOptions.add_arguments(p, "wedlm-serve")
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
    if args.chat_template:
        from decode.text import read_chat_template
        read_chat_template(args.chat_template)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise DecodeConfigError("--enable-auto-tool-choice needs --tool-call-parser "
                                f"({', '.join(sorted(FORMATS))})")
    opts.lora.check_folders(args.model_name)
    return opts


def api_key(args) -> str | None:
    """--api-key, else $WEDLM_API_KEY (API_KEY_ENV), else none."""
    return args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def load_decoder(args, opts: DoorOptions | None = None):
    """(Decoder, tokenizer, ServerConfig) from parsed arguments (and their options, when checked
    already); reads the checkpoint."""
    from decode.checkpoint import OpenCheckpoint
    from decode.engine.runtime.decoder import Decoder
    from decode.engine.planning.plan import door_plan
    from wedlm_jax.model import layers_stacked

    opts = opts or DoorOptions.from_args(args)
    placement = opts.placement
    ckpt = OpenCheckpoint.from_args(args, placement, prog="wedlm-serve")
    tokenizer, stops = ckpt.tokenizer, ckpt.default_stop_ids
    if args.tool_call_parser and not renders_tools(tokenizer.chat_template):
        log.warning("--tool-call-parser %s: the chat template (%s) does not render tools, so "
                    "requests with tools will be refused; start with --chat-template FILE "
                    "(examples: configs/chat_templates/)", args.tool_call_parser,
                    tokenizer.template_source if tokenizer.chat_template else "none")
    if len(stops) > MAX_STOP_IDS:
        raise DecodeConfigError(f"the checkpoint's default stops are {len(stops)} ids, more than {MAX_STOP_IDS}")
    config, params, mesh = ckpt.load()
    decoder = Decoder(params, door_plan(opts, config, capacity=args.capacity, mesh=mesh,
                                        mask_token_id=ckpt.mask_token_id,
                                        top_logprobs=args.max_logprobs,
                                        stacked_params=layers_stacked(params)))
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    if decoder.adapters is not None:
        opts.lora.check_folders(name)
        opts.lora.load_into(decoder.adapters)
    cfg = ServerConfig(model_name=name, capacity=decoder.capacity, vocab_size=config.vocab_size,
                       default_stop_ids=stops, defaults=opts.sampling, api_key=api_key(args),
                       slots=args.slots, method=args.method, window=args.window,
                       max_body_bytes=args.max_body_bytes, max_logprobs=args.max_logprobs,
                       metrics_public=args.metrics_public,
                       constraint_backend=opts.engine.constraint_backend,
                       tool_parser=args.tool_call_parser,
                       auto_tool_choice=args.enable_auto_tool_choice, adapters=decoder.adapters)
    return decoder, tokenizer, cfg


def scorer_for(decoder):
    """The engine's scorer: the AR reading of the Decoder's own weights (decode.serving.scoring)."""
    from decode.serving.scoring import score
    return lambda sequences, top_n: score(decoder.params, decoder.model_config, sequences, top_n,
                                          decoder.static.dtype)


def build_server(args, opts: DoorOptions | None = None, startup: Startup | None = None):
    """(engine, app, ServerConfig): load, compile, start the engine thread; `startup` (the
    server's Startup, answering meanwhile) is told each phase and each program compiled."""
    from decode.engine.runtime.batcher import Batcher
    from decode.metrics import ServerMetrics
    from decode.constraints.backends import warm
    phase = startup.phase if startup is not None else log.info
    opts = opts or DoorOptions.from_args(args)
    phase("reading the checkpoint")
    t0 = time.perf_counter()
    decoder, tokenizer, cfg = load_decoder(args, opts)
    log.info("read the checkpoint in %.1f s", time.perf_counter() - t0)
    # structured outputs compiled with the rest, without the host parser's call (JAX's persistent
    # cache keeps those programs for a restart); unless --constraint-backend device, the programs
    # with it compile after ready, in the background, and the requests that need them wait
    batcher = Batcher(decoder, guided=True, parsers=opts.engine.constraint_backend != "device",
                      window_policy=opts.engine.window_policy)
    t0 = time.perf_counter()
    warm(tokenizer, cfg.vocab_size)
    log.info("read the vocabularies of structured outputs in %.1f s", time.perf_counter() - t0)
    every = not args.lazy_compile
    if startup is not None:
        startup.expect(len(batcher.warm_up_programs(cfg.capacity, every, background=True)))
    phase("compiling" + ("" if every else " (--lazy-compile: the smallest prompt bucket)"))
    seconds = batcher.warm_up(cfg.capacity, every_bucket=every, background=True,
                              progress=startup.progress if startup is not None else None)
    log.info("compiled in %.1f s", seconds)
    if batcher.parser_programs is not None and batcher.parser_programs.holding:
        log.info("the host constraint parser's programs compile in the background; the requests "
                 "that need them wait in the queue until then")
    metrics = ServerMetrics(batcher, cfg.model_name, args.method, log_prompts=args.log_prompts,
                            tokenizer=tokenizer)
    engine = EngineThread(batcher, max_pending=args.slots + args.max_queue,
                          scorer=scorer_for(decoder), metrics=metrics).start()
    return engine, build_app(engine, tokenizer, cfg), cfg


LOADING = "wedlm-serve: interrupted (Ctrl-C) while loading or compiling; not serving"


def _load(args, opts: DoorOptions, startup: Startup, server, failure: list) -> None:
    """The loading thread: build the server behind `startup`; a failure is put in `failure`
    as (exit code, one line) and the HTTP server told to stop."""
    from wedlm_jax.runtime.failures import out_of_memory
    while not server.started and not server.should_exit:    # the port first: /health at once
        time.sleep(0.01)
    try:
        compile_cache.enable(args.compile_cache)
        engine, app, cfg = build_server(args, opts, startup)
    except (DecodeConfigError, ValueError, FileNotFoundError) as e:
        failure.append((2, f"wedlm-serve: error: {e}"))
    except KeyboardInterrupt:
        failure.append((130, "\n" + LOADING))
    except Exception as e:  # noqa: BLE001 - told in one line; the process exits 1
        oom = out_of_memory(e)
        failure.append((1, f"wedlm-serve: error: out of device memory: {oom}; lower --capacity, "
                           "--slots or --window" if oom is not None else
                           f"wedlm-serve: error: loading failed: {type(e).__name__}: {e}"))
    else:
        startup.ready(engine, app, engine.batcher.parser_programs)
        log.info("serving %r (%s, W=%d, %d slots, capacity %d) on http://%s:%d%s",
                 cfg.model_name, args.method, args.window, args.slots, cfg.capacity, args.host,
                 args.port, " (API key required)" if cfg.api_key else "")
        return
    server.should_exit = True


def _http_server(args, startup: Startup):
    """The uvicorn server over `startup`: SIGTERM / SIGINT before ready end the process at once
    (one line); once serving, new work is refused and in-flight requests drain (up to
    --shutdown-timeout); a second Ctrl-C answers what is in flight and exits at once, 130."""
    import uvicorn

    class Server(uvicorn.Server):
        interrupted = False
        served = False          # uvicorn has stopped serving (it then replays the signals it took)

        async def _serve(self, sockets=None):
            try:
                await super()._serve(sockets)
            finally:
                self.served = True

        def handle_exit(self, sig, frame):
            if not startup.is_ready and not self.should_exit:
                if sig == signal.SIGINT:
                    interrupts.exit_now()
                sys.stderr.write("wedlm-serve: stopped (SIGTERM) while loading or compiling; "
                                 "not serving\n")
                sys.stderr.flush()
                os._exit(0)
            engine = startup.engine
            if sig == signal.SIGINT and self.interrupted and not self.served:   # a second Ctrl-C
                if engine is not None:
                    engine.drain("the server was stopped (Ctrl-C twice)")
                sys.stderr.write("wedlm-serve: interrupted (Ctrl-C twice); stopped at once\n")
                sys.stderr.flush()
                os._exit(130)
            self.interrupted = self.interrupted or sig == signal.SIGINT
            if engine is not None and engine.accepting:
                engine.stop_accepting()
                _drain_later(engine, args.shutdown_timeout)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(startup, host=args.host, port=args.port, lifespan="off",
                                 log_level=args.log_level, log_config=None,
                                 timeout_graceful_shutdown=args.shutdown_timeout))


def _drain_later(engine, timeout: float) -> None:
    """What is still running shortly before uvicorn's own deadline is answered (a stream gets an
    error event and [DONE]) instead of cut."""
    grace = max(timeout - 1.0, 0.5 * timeout)
    timer = threading.Timer(grace, lambda: log.warning(
        "shutdown: %d request(s) still running after %.1f s were answered 503",
        engine.drain(f"the server is shutting down; the request was stopped after "
                     f"--shutdown-timeout {timeout:g} s"), grace))
    timer.daemon = True
    timer.start()


def main(argv=None) -> int:
    """The command; Ctrl-C at any moment ends it with 130 and one line (wedlm_jax.runtime.interrupts)."""
    with interrupts.guard("wedlm-serve", LOADING):
        return _main(argv)


def _main(argv=None) -> int:
    from wedlm_jax.runtime import platforms
    platforms.choose()      # no backend whose hardware is absent (a libtpu lock, a CUDA error)
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        opts = _check_args(args)
        Placement.check_dry_run_flags(args)
        if args.dry_run:
            from decode.compile.aot import dry_run_door
            return dry_run_door(args, "wedlm-serve")
        import fastapi  # noqa: F401  (the optional `serve` extra)
        import prometheus_client  # noqa: F401  (the serve extra: GET /metrics)
        import uvicorn  # noqa: F401
        check_port(args.host, args.port)
    except (DecodeConfigError, ValueError) as e:
        print(f"wedlm-serve: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"wedlm-serve: error: {e.name} is missing; install the serve extra: pip install -e "
              f"'.[serve]' in the repository", file=sys.stderr)
        return 2
    return _serve(args, opts)


def _serve(args, opts: DoorOptions) -> int:
    """Open the port at once, load and compile behind it, serve until a signal or a failure."""
    startup = Startup()
    server = _http_server(args, startup)
    failure: list = []
    threading.Thread(target=_load, args=(args, opts, startup, server, failure),
                     name="wedlm-load", daemon=True).start()
    log.info("listening on http://%s:%d while loading: GET /health answers now (liveness), "
             "GET /ready once every program is compiled (readiness)", args.host, args.port)
    # uvicorn re-raises the signal that stopped it once it is done: the same handler takes it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    try:
        server.run()
    finally:
        if startup.engine is not None:
            startup.engine.shutdown(timeout=args.shutdown_timeout)
            if startup.engine.batcher.parser_programs is not None:   # no compile left running
                startup.engine.batcher.parser_programs.stop(timeout=args.shutdown_timeout)
    if failure:
        print(failure[0][1], file=sys.stderr)
        return failure[0][0]
    if server.interrupted:
        print("wedlm-serve: interrupted (Ctrl-C); stopped serving", file=sys.stderr)
        return 130
    return 0 if startup.engine is None or startup.engine.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
