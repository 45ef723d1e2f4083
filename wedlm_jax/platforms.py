"""Which JAX backends a wedlm process starts, decided before JAX starts one.

JAX tries every backend whose plugin is installed. With libtpu installed (the `tpu` extra, or the
TPU compiler the tests use) a process on a machine without a TPU still opens libtpu, which takes a
machine-wide lock (/tmp/libtpu_lockfile): a second process that needs the TPU compiler (a dry run
for a topology) then fails, and every start logs "Unable to initialize backend 'tpu'". A CUDA
plugin on a machine without a GPU (XLA's GPU compiler installed for `--topology h100`) fails its
start likewise. `choose()` leaves out the backends whose plugin is installed but whose hardware
is absent, by setting JAX_PLATFORMS (never when the user set it); a machine with the hardware,
or without such a plugin, keeps JAX's own choice.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import shutil
import sys


def tpu_present() -> bool:
    """A TPU VM exposes its chips as /dev/accel* (v4, v5p) or VFIO groups (v5e, v6e)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def gpu_present() -> bool:
    return (os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
            or shutil.which("nvidia-smi") is not None)


def cuda_plugin_installed() -> bool:
    return any((d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda"))
               for d in importlib.metadata.distributions())


def platforms() -> str | None:
    """The JAX_PLATFORMS value this machine wants, or None for JAX's own choice."""
    libtpu = importlib.util.find_spec("libtpu") is not None
    cuda = cuda_plugin_installed()
    tpu, gpu = tpu_present(), gpu_present()
    if not ((libtpu and not tpu) or (cuda and not gpu)):
        return None
    keep = (["tpu"] if libtpu and tpu else []) + (["cuda"] if cuda and gpu else []) + ["cpu"]
    return ",".join(keep)


def choose() -> None:
    """Set JAX_PLATFORMS from `platforms()` unless the user set it (also in a JAX already
    imported but not started)."""
    if "JAX_PLATFORMS" in os.environ:
        return
    chosen = platforms()
    if chosen is None:
        return
    os.environ["JAX_PLATFORMS"] = chosen
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", chosen)
