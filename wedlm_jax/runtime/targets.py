"""Accelerators to compile for without the hardware: their compile-only devices and
the vendor figures of one chip, by name.

    describe_target("v5p:2x2x2")   a TPU topology, described by libtpu (the `tpu` extra)
    describe_target("h100")        NVIDIA H100 SXM GPUs ("h100:8": eight in one host), described
                                   to XLA's GPU compiler by a target config (jax's CUDA plugin)
    -> (devices, Chip)
    tpu_generation(device)         "v5p", "v5e", "v6e", "v4" of a TPU device (real or
                                   compile-only), None for any other device

A name that is not a known target, or whose compiler is not installed, is a TargetError naming
the accepted forms or the install command.
"""

from __future__ import annotations

import dataclasses
import importlib.util

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip's dense bf16 FLOP/s, HBM bytes/s and HBM bytes (the vendor's published figures)."""
    flops: float
    bandwidth: float
    hbm: int


TPU_CHIPS = {
    "v4": Chip(275e12, 1.2e12, 32 * GIB),
    "v5e": Chip(197e12, 0.819e12, 16 * GIB),
    "v5p": Chip(459e12, 2.765e12, 95 * GIB),
    "v6e": Chip(918e12, 1.64e12, 32 * GIB),
}

# XLA:GPU target configs (GpuTargetConfigProto text): the device as the compiler needs it, figures
# from the vendor sheet (H100 SXM 80GB: 132 SMs, 232,448 B shared memory per block opt-in, 3.35 TB/s
# HBM3, compute capability 9.0)
H100_SXM = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 1 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
GPU_CHIPS = {"h100": (Chip(989e12, 3.35e12, 84942979072), H100_SXM)}

# a TPU device's `device_kind` (as libtpu names it, real chip or compile-only) -> TPU_CHIPS' key
TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
             "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def tpu_generation(device) -> str | None:
    """The TPU generation of `device` (a key of TPU_CHIPS), None for a GPU, a CPU or a TPU
    generation not in the table."""
    if getattr(device, "platform", None) != "tpu":
        return None
    return TPU_KINDS.get(getattr(device, "device_kind", ""))


FORMS = ("TPU topologies GEN:AxB[xC] with GEN one of " + ", ".join(TPU_CHIPS)
         + " (e.g. v5p:1x1x1, v5e:2x4, v6e:2x4, v5p:2x2x2), or GPUs " + ", ".join(GPU_CHIPS)
         + "[:N] (N in one host, e.g. h100, h100:8)")


class TargetError(ValueError):
    """A target name that cannot be compiled for here, with the accepted forms."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:       # its parent package is missing
        return False


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def describe_tpu(name: str) -> tuple[list, Chip]:
    """(compile-only devices, Chip) of a TPU topology name such as 'v5e:2x4', described by libtpu
    without the hardware."""
    gen, _, shape = name.partition(":")
    if gen not in TPU_CHIPS or not shape:
        raise TargetError(f"{name!r}: unknown target; accepted: {FORMS}")
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(f"{name!r}: the TPU compiler is not installed: pip install 'jax[tpu]' "
                          "(or pip install -e '.[tpu]'; a `make setup` checkout holds libtpu in "
                          ".venv/tpu-compiler: put that folder on PYTHONPATH)")
    from jax.experimental import topologies
    kw = {"chips_per_host_bounds": (1, 1, 1)} if shape in ("1x1", "1x1x1") else {}
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw)
    except Exception as e:  # noqa: BLE001 - libtpu's own message, one line
        if "lockfile" in str(e):
            raise TargetError(
                f"{name!r}: the TPU compiler (libtpu) is held by another process (its lock "
                "/tmp/libtpu_lockfile): one process at a time uses it; wait for that one (another "
                "dry run or TPU compile) to end, or set ALLOW_MULTIPLE_LIBTPU_LOAD=1 to share "
                "it") from None
        raise TargetError(f"{name!r}: libtpu cannot describe it ({_first_line(e)}); "
                          f"accepted: {FORMS}") from None
    return list(desc.devices), TPU_CHIPS[gen]


def describe_gpu(name: str) -> tuple[list, Chip]:
    """(compile-only devices, Chip) of 'h100' or 'h100:N' (N GPUs in one host), described to
    XLA's GPU compiler by the chip's target config."""
    chip_name, _, count = name.partition(":")
    if chip_name not in GPU_CHIPS or (count and not (count.isdigit() and int(count) >= 1)):
        raise TargetError(f"{name!r}: unknown target; accepted: {FORMS}")
    if not _installed("jax_plugins.xla_cuda12"):
        raise TargetError(f"{name!r}: XLA's GPU compiler is not installed: pip install "
                          "'jax[cuda12]' (or, compile-only, `make gpu-compiler`: jax-cuda12-plugin "
                          "and jax-cuda12-pjrt into .venv/gpu-compiler, on PYTHONPATH)")
    from jax.experimental import topologies
    chip, config = GPU_CHIPS[chip_name]
    try:
        desc = topologies.get_topology_desc(platform="cuda", topology_name=chip_name,
                                            target_config=config, topology=f"1x1x{count or 1}")
    except Exception as e:  # noqa: BLE001 - the plugin's own message, one line
        raise TargetError(f"{name!r}: XLA's GPU compiler cannot describe it ({_first_line(e)})") from None
    return list(desc.devices), chip


def describe_target(name: str) -> tuple[list, Chip]:
    """A TPU topology or GPU name (with or without a 'tpu:' / 'cuda:' prefix) -> (devices, Chip)."""
    platform, _, rest = name.partition(":")
    if platform in ("tpu", "cuda", "gpu") and rest:
        name = rest
    return (describe_gpu if name.partition(":")[0] in GPU_CHIPS else describe_tpu)(name)
