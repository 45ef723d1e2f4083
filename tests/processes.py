"""Subprocesses the tests start and wait for."""

from __future__ import annotations

import os
import signal
import time


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
