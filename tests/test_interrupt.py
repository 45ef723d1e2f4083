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
