"""What the device is and what it can do, measured in the same process as the figures it bounds:
its kind and memory with the vendor's nominal peaks, the copy rate and the bf16 matmul rate."""

from __future__ import annotations

import datetime
import os
import statistics
import time

GIB = 1024 ** 3

# device kind (lower-case substring, most specific first) -> (dense bf16 FLOP/s, HBM bytes/s),
# the vendors' nominal figures
NOMINAL = [
    ("h100 pcie", 756e12, 2.0e12), ("h100", 989e12, 3.35e12), ("h200", 989e12, 4.8e12),
    ("gh200", 989e12, 4.0e12), ("a100-sxm4-40gb", 312e12, 1.555e12), ("a100", 312e12, 2.0e12),
    ("l40s", 362e12, 0.864e12), ("l4", 121e12, 0.3e12),
    ("tpu v6", 918e12, 1.64e12), ("tpu v5 lite", 197e12, 0.819e12), ("tpu v5e", 197e12, 0.819e12),
    ("tpu v5", 459e12, 2.765e12), ("tpu v4", 275e12, 1.2e12),
]


def device_info(memory_override_gib: float | None = None) -> dict:
    import jax
    dev = jax.devices()[0]
    stats = {}
    try:
        stats = dev.memory_stats() or {}
    except Exception:                                         # CPU has none on some versions
        stats = {}
    memory = stats.get("bytes_limit")
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if memory_override_gib is not None:
        memory = int(memory_override_gib * GIB)
    kind = getattr(dev, "device_kind", dev.platform)
    nominal = next(((f, b) for key, f, b in NOMINAL if key in kind.lower()), (None, None))
    return {"platform": jax.default_backend(), "device_kind": kind,
            "device_count": jax.device_count(), "memory_bytes": int(memory),
            "nominal_bf16_flops": nominal[0], "nominal_hbm_bytes_per_s": nominal[1],
            "jax": jax.__version__, "host_cpus": os.cpu_count(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}


def median_time(fn, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s of x + 1 over a bf16 array of `nbytes` (read nbytes, write nbytes)."""
    import jax
    import jax.numpy as jnp
    n = nbytes // 2
    x = jax.jit(lambda: jnp.zeros((n,), jnp.bfloat16))()
    f = jax.jit(lambda x: x + 1)
    t = median_time(lambda: f(x), max(repeats, 3))
    return 2 * n * 2 / t


def probe_matmul(n: int, repeats: int) -> float:
    """FLOP/s of an n x n x n bf16 matmul (f32 accumulation)."""
    import jax
    import jax.numpy as jnp
    a = jax.jit(lambda: jnp.ones((n, n), jnp.bfloat16))()
    b = jax.jit(lambda: jnp.full((n, n), 0.5, jnp.bfloat16))()
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    t = median_time(lambda: f(a, b), max(repeats, 3))
    return 2.0 * n ** 3 / t


def host_facts() -> dict:
    """What a CPU figure depends on, recorded beside it: the device, cores, architecture, jax and
    the load average while it ran (this VM is shared)."""
    import platform

    import jax
    return dict(device=str(jax.devices()[0]), cpus=os.cpu_count(), machine=platform.machine(),
                jax=jax.__version__, load_average=[round(x, 2) for x in os.getloadavg()])
