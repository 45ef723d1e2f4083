"""Ctrl-C at any moment of load, compile or work: wedlm-decode, wedlm-serve and wedlm-train exit
130 with one line last on stderr, never a traceback, an interrupt swallowed by a garbage
collector callback ("Exception ignored"), a run that goes on, or a crash. Each command gets
SIGINT at several delays after launch (the imports, the checkpoint read, the compiles, the
work), twice each (WEDLM_INTERRUPT_TRIES=10: ten times each)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.live_server import ROOT, free_port
from tests.synthetic import train_data as fixtures

DEMO = os.path.join(ROOT, "demo", "model")
DELAYS = (0.6, 1.5, 3.0)   # from the command's first line on (before it: Python's start)
TRIES = int(os.environ.get("WEDLM_INTERRUPT_TRIES", "2"))   # 10 for the figure in BENCHMARKS.md


def _interrupted(cmd: list, delay: float) -> tuple[int, str]:
    """(exit code, stderr) of `cmd` sent SIGINT `delay` s after launch (killed after 60 s)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=60), proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _check(cmd: list, prog: str) -> None:
    for delay in DELAYS:
        for _ in range(TRIES):
            code, err = _interrupted(cmd, delay)
            lines = err.strip().splitlines()
            assert code == 130, (delay, code, err[-2000:])
            assert lines and lines[-1].startswith(f"{prog}: "), (delay, err[-2000:])
            assert "interrupted" in lines[-1] or "stopped by SIGINT" in lines[-1], lines[-1]
            assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]


def test_wedlm_decode():
    _check([sys.executable, "-m", "decode.cli", "--checkpoint", DEMO, "--prompt", "Count: 1, 2,",
            "--max-new-tokens", "256"], "wedlm-decode")


def test_wedlm_serve():
    pytest.importorskip("fastapi")
    _check([sys.executable, "-m", "decode.serving.serve", "--checkpoint", DEMO, "--port",
            str(free_port()), "--lazy-compile"], "wedlm-serve")


def test_wedlm_train(tmp_path):
    paths = fixtures.make_tiny_setup(str(tmp_path), num_docs=40)
    cfg = fixtures.write_config(str(tmp_path / "cfg.yaml"),
                                fixtures.tiny_config_dict(paths, steps=400))
    _check([sys.executable, "-m", "train.main", "--config", cfg], "wedlm-train")


def test_wedlm_serve_second_ctrl_c_stops_at_once_while_a_request_drains():
    """Ctrl-C while a request runs: the server stops taking work and lets it drain (up to
    --shutdown-timeout, 30 s here); a second Ctrl-C ends it at once: the request in flight is
    answered, exit 130, one line last."""
    pytest.importorskip("fastapi")
    import threading

    import httpx

    from tests.live_server import start_subprocess_server
    proc, url = start_subprocess_server(DEMO, "--lazy-compile", "--no-default-stops",
                                        "--shutdown-timeout", "30", "--slots", "2")
    try:
        answer = {}

        def long_request():
            try:
                r = httpx.post(url + "/v1/completions", json={
                    "model": "model", "prompt": "Count: 1, 2,", "max_tokens": 2000}, timeout=60)
                answer["status"] = r.status_code
            except httpx.HTTPError as e:
                answer["error"] = repr(e)
        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        deadline = time.time() + 30
        running = 'vllm:num_requests_running{model_name="model"} 1.0'
        while time.time() < deadline and running not in httpx.get(url + "/metrics", timeout=5).text:
            time.sleep(0.1)
        assert not answer, answer                      # running, not refused
        proc.send_signal(signal.SIGINT)
        time.sleep(1.5)
        assert proc.poll() is None                     # the first Ctrl-C drains
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=10)
        assert code == 130 and time.time() - t0 < 5
        lines = proc.stdout.read().decode().strip().splitlines()
        assert lines[-1] == "wedlm-serve: interrupted (Ctrl-C twice); stopped at once", lines[-5:]
        assert not any("Traceback" in l for l in lines)
        t.join(10)
        assert answer and not t.is_alive(), answer     # the client was answered, not left hanging
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
