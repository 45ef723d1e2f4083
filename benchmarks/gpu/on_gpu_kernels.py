"""The cache-attention kernels on a card (`benchmarks.gpu.on_gpu`'s parts `kernel` and `kernel_time`):
every backend against the dense reference, and each Triton kernel timed alone."""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks.gpu.on_gpu_report import error_line
from benchmarks.probes import median_time


def kernel(smoke: bool) -> list[dict]:
    """Each cache-attention backend and the paged gather path against the dense reference."""
    import jax
    import jax.numpy as jnp

    from wedlm_jax.attention import backends as ab
    from wedlm_jax.attention import cache as ca
    from wedlm_jax.attention import paged as pa
    b, h, kvh, d, t = (2, 4, 2, 16, 96) if smoke else (8, 32, 8, 128, 4160)
    interpret = smoke
    out = []
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        impls = ab.available("cache", backend=jax.default_backend(), dtype=dtype,
                             interpret=interpret)
        for s in (1, 16, 32):
            q = jnp.asarray(rng.standard_normal((b, s, h, d)), dtype)
            k = jnp.asarray(rng.standard_normal((b, t, kvh, d)), dtype)
            v = jnp.asarray(rng.standard_normal((b, t, kvh, d)), dtype)
            lens = jnp.asarray(rng.integers(0, t - s + 1, size=b), jnp.int32)
            scale = d ** -0.5
            with jax.default_matmul_precision("highest"):
                ref = np.asarray(ca.attend_cache_dense(q.astype(jnp.float32), k.astype(jnp.float32),
                                                       v.astype(jnp.float32), lens, scale), np.float64)
            runs = {impl: (lambda impl=impl: ca.attend_cache(
                impl, q, k, v, lens, scale,
                tile=ca.pallas_tile(256, s * (h // kvh), d, jnp.dtype(dtype).itemsize,
                                    ca.smem_limit(jax.devices()[0])) if impl == "pallas" else 256,
                interpret=interpret)) for impl in impls if impl != "dense"}
            page = 64 if not smoke else 16
            pages = t // page          # t is a multiple of the page

            def paged(page=page, pages=pages):
                pool = pa.interleave(k, v).reshape(b * pages, page, 2 * kvh, d)
                table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
                return pa.attend_pages("gather", q, pool, table, lens, scale)

            def paged_triton(page=page, pages=pages):
                pool = pa.interleave(k, v).reshape(b * pages, page, 2 * kvh, d)
                table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
                return pa.attend_pages_triton(q, pool, table, lens, scale, interpret=interpret)
            runs["paged gather"] = paged
            if jax.default_backend() == "gpu" or interpret:
                runs["paged triton"] = paged_triton
            for name, fn in runs.items():
                row = dict(dtype=jnp.dtype(dtype).name, slots=s, backend=name)
                try:
                    got = np.asarray(jax.jit(fn)(), np.float64)
                    row["rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    row["nan"] = bool(np.isnan(got).any())
                except Exception as e:                  # one backend failing keeps the others
                    row["failed"] = error_line(e)
                out.append(row)
    return out


# (batch, live rows, query slots): a long context at batch 1, the served batch at 2K, windows
KERNEL_POINTS = ((1, 16384, 1), (1, 16384, 16), (1, 2048, 16), (8, 2048, 1), (8, 2048, 16))
KERNEL_SPLITS = (1, 4, 16)


def kernel_time(smoke: bool, clock, info: dict) -> list[dict]:
    """Each cache-attention kernel alone, as a step runs it: `layers` layers' calls (a static
    layer each) in one jitted program over the stacked cache or the pool, bf16, the 8B heads (32
    query / 8 KV, head_dim 128): the Triton kernel on the dense cache and the Triton paged kernel
    at each of KERNEL_SPLITS, and the paged gather path; median ms per layer and the live K/V
    bytes a layer reads over it (GB/s, against the card's copy rate)."""
    import jax
    import jax.numpy as jnp

    from wedlm_jax.attention import cache as ca
    from wedlm_jax.attention import paged as pa
    layers, h, kvh, d, page = (2, 4, 2, 16, 16) if smoke else (8, 32, 8, 128, 64)
    points = ((1, 64, 1), (2, 32, 4)) if smoke else KERNEL_POINTS
    out = []
    for b, live, s in points:
        cap = -(-(live + s) // page) * page
        pages = cap // page
        rng = jax.random.split(jax.random.key(b * live + s), 3)
        q = jax.random.normal(rng[0], (b, s, h, d), jnp.bfloat16)
        lens = jnp.full((b,), live, jnp.int32)
        kv_bytes = b * (live + s) * kvh * d * 2 * 2
        table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        variants = [(f"dense pallas, {n} split{'s' * (n > 1)}", "dense", n) for n in KERNEL_SPLITS]
        variants += [(f"paged triton, {n} split{'s' * (n > 1)}", "triton", n) for n in KERNEL_SPLITS]
        variants.append(("paged gather, 16 pages a tile", "gather", 1))
        k = jax.random.normal(rng[1], (layers, b, cap, kvh, d), jnp.bfloat16)
        v = jax.random.normal(rng[2], (layers, b, cap, kvh, d), jnp.bfloat16)
        pool = pa.interleave(k, v).reshape(layers * b * pages, page, 2 * kvh, d)
        for name, kind, n in variants:
            if clock.left() < 30:
                out.append(dict(batch=b, live=live, slots=s, kernel=name, skipped="time budget"))
                continue
            row = dict(batch=b, live=live, slots=s, kernel=name)

            def one(q, k, v, pool, kind=kind, n=n):
                acc = jnp.zeros(q.shape, jnp.float32)
                for layer in range(layers):
                    if kind == "dense":
                        o = ca.attend_cache_pallas(q, k, v, lens, 0.1, 64, layer=layer, splits=n,
                                                   interpret=smoke)
                    elif kind == "triton":
                        o = pa.attend_pages_triton(q, pool, table, lens, 0.1,
                                                   first_page=layer * b * pages, splits=n,
                                                   interpret=smoke)
                    else:
                        o = pa.attend_pages_gather(q, pool, table, lens, 0.1,
                                                   1024 // page, first_page=layer * b * pages)
                    acc = acc + o.astype(jnp.float32)
                return acc
            try:
                fn = jax.jit(one)
                jax.block_until_ready(fn(q, k, v, pool))
                times = []
                for _ in range(3 if smoke else 15):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v, pool))
                    times.append((time.perf_counter() - t0) / layers)
                t = statistics.median(times)
                row.update(ms_per_layer=t * 1e3, gb_per_s=kv_bytes / t / 1e9,
                           of_copy_rate=kv_bytes / t / info.get("hbm_bytes_per_s", float("inf")))
            except Exception as e:
                row["failed"] = error_line(e)
            out.append(row)
        del k, v, pool
    return out


# (rows, K, N) of the 8B model's projections: AR at 8 slots (q / o, down), the window's 256 rows
# (gate / up), a 2K prefill chunk
QMATMUL_POINTS = ((8, 4096, 4096), (8, 12288, 4096), (256, 4096, 12288), (2048, 4096, 12288))


def qmatmul(smoke: bool, info: dict) -> list[dict]:
    """The grouped int4 matmul kernel (wedlm_jax.grouped_matmul, groups of 64) at the 8B model's
    projection shapes: its error against the dequantized kernel's float32 matmul at HIGHEST
    precision, and its time alone (median of 15 calls: the values' and scales' bytes over it,
    against the card's copy rate) beside XLA's gemm of the dequantized kernel (what a
    projection past `grouped_matmul.MAX_ROWS` rows runs)."""
    import jax
    import jax.numpy as jnp
    import qwix

    from wedlm_jax import grouped_matmul as gm
    from wedlm_jax import quantize as q
    points = ((8, 256, 128), (40, 128, 64)) if smoke else QMATMUL_POINTS
    out = []
    for m, k, n in points:
        row = dict(kernel="grouped int4 matmul, groups of 64", rows=m, k=k, n=n)
        try:
            keys = jax.random.split(jax.random.key(m + k + n))
            w = q.quantize_kernel(jax.random.normal(keys[0], (k, n), jnp.float32) * 0.05,
                                  "int4", 1, 64)
            w = w.replace(scale=w.scale.astype(jnp.bfloat16))
            x = jax.random.normal(keys[1], (m, k), jnp.bfloat16)
            with jax.default_matmul_precision("highest"):
                ref = np.asarray(x.astype(jnp.float32) @ qwix.dequantize(w).astype(jnp.float32))
            fn = jax.jit(lambda x, v, s: gm.grouped_matmul(x, v, s, group=64, interpret=smoke))
            got = np.asarray(fn(x, w.qvalue, w.scale).astype(jnp.float32))
            row.update(rel_err=float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                       nan=bool(np.isnan(got).any()))
            xla = jax.jit(lambda x, v, s: x @ qwix.dequantize(w.replace(qvalue=v, scale=s)))
            calls = 3 if smoke else 15
            t = median_time(lambda: fn(x, w.qvalue, w.scale), calls)
            moved = k * n // 2 + (k // 64) * n * 2 + m * (k + n) * 2
            row.update(us=t * 1e6, gb_per_s=moved / t / 1e9,
                       of_copy_rate=moved / t / info.get("hbm_bytes_per_s", float("inf")),
                       xla_dequantized_us=median_time(lambda: xla(x, w.qvalue, w.scale),
                                                      calls) * 1e6)
        except Exception as e:
            row["failed"] = error_line(e)
        out.append(row)
    return out

