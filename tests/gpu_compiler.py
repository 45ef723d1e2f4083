"""Where the tests find XLA's GPU compiler (no GPU needed): `make setup` (or `make gpu-compiler`
alone) installs it into .venv/gpu-compiler; the GPU compile tests run in subprocesses with that
folder on their path and CPU as jax's own platform."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_COMPILER = os.path.join(ROOT, ".venv", "gpu-compiler")


def run_for_the_gpu(script: str) -> dict:
    """Run `script` in a process with XLA's GPU compiler (no GPU: JAX_PLATFORMS=cpu); its
    "RESULT {json}" line."""
    assert os.path.isdir(os.path.join(GPU_COMPILER, "jax_plugins")), (
        f"XLA's GPU compiler is not in {GPU_COMPILER}: run `make setup` (or `make gpu-compiler`)")
    env = dict(xla.full_compile(os.environ), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, GPU_COMPILER]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
