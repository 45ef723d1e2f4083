"""Which JAX backends a wedlm process starts, decided before JAX starts one.

JAX tries the TPU backend on every Linux machine and every installed GPU plugin. Without a TPU
that logs "Unable to initialize backend 'tpu'" at each start, and with libtpu installed (the `tpu`
extra, or the TPU compiler the tests use) it opens libtpu, which takes a machine-wide lock
(/tmp/libtpu_lockfile): a second process that needs the TPU compiler (a dry run for a topology)
then fails. A CUDA plugin on a machine without a GPU (XLA's GPU compiler installed for
`--topology h100`) fails its start likewise. `choose()` leaves out the backends whose hardware is
absent, by setting JAX_PLATFORMS (never when the user set it).
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
import sys


def tpu_present() -> bool:
    """A TPU VM exposes its chips as /dev/accel* (v4, v5p) or VFIO groups (v5e, v6e)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def gpu_present() -> bool:
    return (os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
            or shutil.which("nvidia-smi") is not None)


def plugin_installed(prefix: str) -> bool:
    """Whether a jax plugin distribution (jax-cuda12-plugin, jax-rocm60-plugin, ...) is installed."""
    return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith(prefix)
               for d in importlib.metadata.distributions())


def platforms() -> str | None:
    """The JAX_PLATFORMS value this machine wants, or None for JAX's own choice: the backends
    whose hardware is here (JAX tries the TPU one on every Linux machine, and each installed GPU
    plugin), then the CPU."""
    tpu, gpu, amd = tpu_present(), gpu_present(), os.path.exists("/dev/kfd")
    cuda, rocm = plugin_installed("jax-cuda"), plugin_installed("jax-rocm")
    if tpu and (gpu or not cuda) and (amd or not rocm):
        return None
    keep = (["tpu"] if tpu else []) + (["cuda"] if cuda and gpu else []) \
        + (["rocm"] if rocm and amd else []) + ["cpu"]
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
