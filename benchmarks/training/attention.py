"""Dual-stream attention, forward + backward: tiled (tile-skipping) vs dense masked, side by side.

    python benchmarks/training/attention.py                       # L = 1024 2048 4096, 8 heads, d 64, B 1
    python benchmarks/training/attention.py --lengths 1024 --tile 128 --reps 3
    python benchmarks/training/attention.py --model               # + compiled memory of a ~100M train step

For each L the input is one document of L tokens arranged dual-stream (2L slots, block 32). Both
paths compute d/d(q, k, v) of sum(attention(q, k, v) * w) under one `jax.jit`; the time is the
median of `--reps` runs after a warm-up run. Peak memory is XLA's compiled `memory_analysis()`
(temporaries + outputs + arguments) of the same jitted function, so it is the per-device peak
the compiler plans, without running anything. "computed" is the fraction of tile pairs the tiled
path visits (EMPTY pairs are skipped); 25% is the limit the mask density sets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax import masking
from wedlm_jax.attention import core as attention
from wedlm_jax.attention import tiled as ta


def _memory(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes + m.argument_size_in_bytes)


def _time(fn, args, reps):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def attention_case(length, *, heads, kv_heads, head_dim, block, tile, reps, dtype):
    s = ta.dual_stream_structure(np.ones((1, length), np.int32), block)
    t = 2 * length
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, t, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (1, t, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (1, t, kv_heads, head_dim), dtype)
    w = jax.random.normal(keys[3], (1, t, heads, head_dim), dtype)
    scale = head_dim ** -0.5

    def grads(attn):
        def f(q, k, v, s):
            loss = lambda q, k, v: jnp.sum(attn(q, k, v, s).astype(jnp.float32) * w)
            return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
        return jax.jit(f)

    impls = {
        "tiled": grads(lambda q, k, v, s: ta.tiled_attention(q, k, v, s, s, scale, tile_q=tile,
                                                             tile_k=tile)),
        "dense": grads(lambda q, k, v, s: attention.attend(q, k, v, masking.structure_mask(s),
                                                           scale)),
    }
    counts = ta.plan_counts(ta.tile_plan(s, s, tile, tile))
    row = {"L": length, "slots": t, "tile": tile,
           "computed_fraction": (counts["total"] - counts["empty"]) / counts["total"],
           "mask_density": float(jnp.mean(masking.structure_mask(s)))}
    results = {}
    for name, fn in impls.items():
        compiled = fn.lower(q, k, v, s).compile()
        row[f"{name}_peak_bytes"] = _memory(compiled)
        results[name] = fn(q, k, v, s)
        row[f"{name}_s"] = _time(fn, (q, k, v, s), reps)
    (_, gt), (_, gd) = results["tiled"], results["dense"]
    row["max_rel_err"] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                             for a, b in zip(gt, gd))
    row["speedup"] = row["dense_s"] / row["tiled_s"]
    row["memory_ratio"] = row["tiled_peak_bytes"] / row["dense_peak_bytes"]
    return row


def model_memory(length, tile):
    """Compiled peak memory of loss + grad of a ~100M-parameter Transformer (remat, f32) on a
    dual-stream batch of one row of `length` tokens, tiled vs dense attention."""
    from wedlm_jax import losses, model as model_lib
    from wedlm_jax.config import ModelConfig
    cfg = ModelConfig(model_type="qwen3", vocab_size=32000, hidden_size=640,
                      intermediate_size=2560, num_layers=12, num_heads=10, num_kv_heads=5,
                      head_dim=64, mask_token_id=31999)
    params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
    tokens = jnp.zeros((1, length), jnp.int32)
    seg = jnp.ones((1, length), jnp.int32)
    out = {"params_M": cfg.num_params() / 1e6, "L": length}
    for impl in ("tiled", "dense"):
        def loss(p, tokens, seg):
            arr = masking.arrange_rows("dual", masking.row_keys(0, 0, jnp.arange(1)), tokens, seg,
                                       seg != 0, block_size=32, mask_token_id=31999)
            m = model_lib.Transformer(cfg, remat=True, attention=impl, attention_tile=tile)
            logits = m.apply({"params": p}, arr["tokens"], arr["positions"], structure=arr)
            return losses.combine(losses.loss_terms(logits, arr))[0]
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens, seg).compile()
        out[f"{impl}_peak_bytes"] = _memory(compiled)
    out["memory_ratio"] = out["tiled_peak_bytes"] / out["dense_peak_bytes"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--tile", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--model", action="store_true",
                   help="also the compiled memory of a ~100M train step at L = 4096")
    p.add_argument("--json", help="append the rows as JSON lines to this file")
    a = p.parse_args(argv)
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{jax.devices()[0].device_kind}")
    print(f"# heads {a.heads}/{a.kv_heads} kv, head_dim {a.head_dim}, batch 1, block {a.block}, "
          f"tile {a.tile}, {a.dtype}, median of {a.reps}")
    print("| L | slots | tiles computed | tiled fwd+bwd s | dense fwd+bwd s | speed-up | "
          "tiled peak MiB | dense peak MiB | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for length in a.lengths:
        r = attention_case(length, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                           block=a.block, tile=a.tile, reps=a.reps, dtype=jnp.dtype(a.dtype))
        rows.append(r)
        print(f"| {r['L']} | {r['slots']} | {100 * r['computed_fraction']:.1f}% | "
              f"{r['tiled_s']:.3f} | {r['dense_s']:.3f} | {r['speedup']:.2f}x | "
              f"{r['tiled_peak_bytes'] / 2**20:.0f} | {r['dense_peak_bytes'] / 2**20:.0f} | "
              f"{r['max_rel_err']:.1e} |", flush=True)
    if a.model:
        m = model_memory(4096, a.tile)
        rows.append(m)
        print(f"\n~{m['params_M']:.0f}M-parameter train step (loss + grad, remat, f32), "
              f"L = {m['L']} dual-stream: compiled peak tiled "
              f"{m['tiled_peak_bytes'] / 2**20:.0f} MiB vs dense "
              f"{m['dense_peak_bytes'] / 2**20:.0f} MiB ({100 * m['memory_ratio']:.0f}%)")
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
