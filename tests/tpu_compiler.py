"""Where the tests find the TPU compiler (libtpu): `make setup` installs the version the installed
jax asks for into .venv/tpu-compiler (kept out of the venv, so that no other test process tries to
start a TPU backend); $WEDLM_TPU_COMPILER names another folder. The TPU compile tests run in
subprocesses with that folder on their path."""

import os

from tests import xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def folder() -> str:
    return os.environ.get("WEDLM_TPU_COMPILER") or os.path.join(ROOT, ".venv", "tpu-compiler")


def env(**extra) -> dict:
    """The environment of a subprocess that compiles for TPU: this checkout and libtpu on the
    path, CPU as jax's own platform, several libtpu processes allowed (pytest -n 2)."""
    path = [ROOT, folder()] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return dict(xla.full_compile(os.environ), JAX_PLATFORMS="cpu",
                ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=os.pathsep.join(path), **extra)


def installed() -> bool:
    return os.path.isdir(os.path.join(folder(), "libtpu"))
