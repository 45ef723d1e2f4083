"""wedlm processes start no JAX backend whose hardware is absent (wedlm_jax/runtime/platforms.py): with
libtpu installed on a machine without a TPU they never open libtpu (its machine-wide lock stays
free for a dry run beside them), with a CUDA plugin and no GPU they start on the CPU."""

import os
import subprocess
import sys

import pytest

from tests import tpu_compiler
from wedlm_jax.runtime import platforms


@pytest.mark.parametrize("cuda, tpu, gpu, want", [
    (False, False, False, "cpu"),          # a CPU machine: JAX would try (and log) the TPU one
    (False, True, False, None),            # a TPU VM: JAX's own choice
    (True, False, False, "cpu"),           # XLA's GPU compiler without a GPU
    (True, False, True, "cuda,cpu"),       # a GPU machine
    (True, True, True, None),
])
def test_the_backends_left_out(monkeypatch, cuda, tpu, gpu, want):
    monkeypatch.setattr(platforms, "plugin_installed", lambda prefix: cuda and prefix == "jax-cuda")
    monkeypatch.setattr(platforms, "tpu_present", lambda: tpu)
    monkeypatch.setattr(platforms, "gpu_present", lambda: gpu)
    assert platforms.platforms() == want
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platforms.sys, "modules", {})
    platforms.choose()
    assert os.environ.get("JAX_PLATFORMS") == want
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")      # the user's choice is kept
    platforms.choose()
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_a_cpu_process_with_libtpu_installed_never_opens_it():
    assert tpu_compiler.installed(), "make setup installs the TPU compiler into .venv/tpu-compiler"
    env = {k: v for k, v in tpu_compiler.env().items()
           if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    code = ("import os\nfrom wedlm_jax.runtime import platforms\nplatforms.choose()\nimport jax\n"
            "print(os.environ['JAX_PLATFORMS'], jax.devices()[0].platform)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["cpu", "cpu"]
    assert "backend 'tpu'" not in r.stderr and "libtpu" not in r.stderr, r.stderr[-2000:]
