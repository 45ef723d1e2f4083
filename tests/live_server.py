"""Servers the tests start: the app in a thread of the test process, `wedlm-serve` as a
subprocess, and the small engine the fuzz tests run; all on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_in_thread(app, log_level="warning"):
    """(url, uvicorn server, thread, socket): `app` served on 127.0.0.1 from a thread, started."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    thread = threading.Thread(target=srv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started
    return f"http://127.0.0.1:{sock.getsockname()[1]}", srv, thread, sock


def start_subprocess_server(path, *args, env=None):
    """(process, url): `python -m decode.serving.serve` on a free port, once ready (/ready 200;
    /health, liveness, answers from launch)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "decode.serving.serve", "--checkpoint", path,
                             "--port", str(port), *args],
                            cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return proc, url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_engine(path: str, capacity: int):
    """(engine, batcher, tokenizer, server config) of a small server over the checkpoint at
    `path`: 4 slots, W 4, a queue of 16, no default stops, every prompt bucket's programs compiled
    (the engine thread started)."""
    from decode.serving import serve
    from decode.engine.runtime.batcher import Batcher
    args = serve._parser().parse_args(["--checkpoint", path, "--slots", "4", "--window", "4",
                                       "--capacity", str(capacity), "--max-queue", "16",
                                       "--no-default-stops", "--model-name", "tiny",
                                       "--max-body-bytes", "65536"])
    decoder, tokenizer, cfg = serve.load_decoder(args)
    batcher = Batcher(decoder)
    batcher.warm_up(capacity, every_bucket=False)
    engine = serve.EngineThread(batcher, max_pending=4 + 16, scorer=serve.scorer_for(decoder)).start()
    return engine, batcher, tokenizer, cfg
