"""Subprocesses the tests start and wait for."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSIDE = "WEDLM_TEST_LOOPBACK_ONLY"      # tells a test file run by `in_loopback_namespace` so


def in_loopback_namespace(inner: str, passed: int, timeout: float) -> None:
    """Run the test file `inner` (under tests/) by pytest in a fresh network namespace holding
    only the loopback device, up (`unshare --net`, as root): Ray's servers listen on every
    interface of the host whatever their node address. Asserts its `passed` tests pass."""
    path = os.path.join(ROOT, "tests", inner)
    script = (f"ip link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider "
              f"-p no:xdist {path}")
    proc = subprocess.run(["unshare", "--net", "sh", "-c", script], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, **{INSIDE: "1"}), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(rf"\b{passed} passed", proc.stdout) and "failed" not in proc.stdout, \
        proc.stdout[-2000:]


def wait_all(procs, seconds: float) -> None:
    """Wait for every process in `procs` up to `seconds` in all; then SIGKILL (and reap) those
    still running, so a hung test leaves nothing behind."""
    deadline = time.time() + seconds
    try:
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
