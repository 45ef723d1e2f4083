"""A server's start, cold and again with its compile cache: seconds from launch to liveness
(`GET /health` 200) and to readiness (`GET /ready` 200), polled every 0.2 s, and, where the host
constraint parser's programs compile after ready, to `GET /ready`'s `host_parser_programs`
"compiled".

    python -m benchmarks.doors.cold_start [--checkpoint demo/model] [--restarts 1]
        [--out benchmarks/results/cold_start.json] [-- SERVER OPTIONS...]

The first start uses a fresh `--compile-cache` folder (everything compiled); each restart reuses
it (JAX's persistent cache). The server listens on 127.0.0.1 and is stopped (SIGINT, then killed
after 30 s) once ready and its host parser's programs are compiled; only the processes started
here are stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT_S = 1200


def status(port: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def host_parser(port: int) -> str | None:
    """`GET /ready`'s host_parser_programs (None: not reported, or no answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return json.load(r).get("host_parser_programs")
    except (OSError, ValueError):
        return None


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(checkpoint: str, cache: str, extra: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "decode.serving.serve", "--checkpoint", checkpoint,
           "--host", "127.0.0.1", "--port", str(port), "--compile-cache", cache, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = {}
    try:
        while time.perf_counter() - t0 < LIMIT_S and "done" not in got:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            now = time.perf_counter() - t0
            if "health_s" not in got and status(port, "/health") == 200:
                got["health_s"] = round(now, 2)
            if "health_s" in got and "ready_s" not in got and status(port, "/ready") == 200:
                got["ready_s"] = round(now, 2)
            family = host_parser(port) if "ready_s" in got else "compiling"
            if family != "compiling":
                if family == "compiled":
                    got["host_parser_s"] = round(now, 2)
                got["done"] = True
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    got.pop("done", None)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.doors.cold_start",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "demo", "model"))
    ap.add_argument("--restarts", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("server", nargs=argparse.REMAINDER, help="options passed to wedlm-serve")
    a = ap.parse_args(argv)
    extra = [x for x in a.server if x != "--"]
    with tempfile.TemporaryDirectory() as cache:
        runs = [dict(one_start(a.checkpoint, cache, extra), cache="fresh")]
        for _ in range(a.restarts):
            runs.append(dict(one_start(a.checkpoint, cache, extra), cache="warm"))
    for r in runs:
        host = (f", host parser's programs {r['host_parser_s']} s" if "host_parser_s" in r
                else "")
        print(f"{r['cache']:>5} compile cache: liveness {r.get('health_s')} s, "
              f"readiness {r.get('ready_s')} s{host}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"checkpoint": a.checkpoint, "server_options": extra, "runs": runs}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
