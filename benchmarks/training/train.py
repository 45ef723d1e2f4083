"""Training throughput: tokens/s and MFU of the jitted train step, and the attention share.

    python -m benchmarks.training.train                       # tiny and ~100M configs, seq len 1024
    python -m benchmarks.training.train --models tiny --steps 5 --seq-len 256
    python -m benchmarks.training.train --attention dense     # the dense-mask reference path

For each model: the dual-stream train step (the same `train.step.make_train_step` the program
runs: on-device masking, attention over the arrangement's structure (tiled by default on CPU, or
the dense mask), loss, backward, AdamW) on one device, rows of `seq_len` tokens
(one document each), f32 compute. Reported:
  - step time (median of the timed steps, after one compile+warm-up step),
  - tokens/s = training tokens (rows x seq_len; the network sees 2x that in dual-stream) / step time,
  - MFU = model FLOPs of the step (`train.step.model_flops_per_row`: matmuls of the 2L fed slots
    plus attention over the (query, key) pairs the dual-stream mask allows, about a quarter of
    the dense 2L x 2L, x3 for forward+backward) / step time / the f32
    matmul rate of this machine measured in the same run right before each timed step (an n^3
    jnp.dot, n = --matmul-n, 2048, best of 3): the median over the timed steps (the machine is
    shared, so the rate is re-measured under the same load as each step),
  - attention share = num_layers x time(forward+backward of the attention core the step uses, on
    the step's q/k/v shapes, mask or tile plan built from the structure, timed right after each
    step) / step time, median over steps; and the attention share of the model FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from train import step as step_lib
from train.config import load_config
from wedlm_jax.attention import core as attn_lib
from wedlm_jax.attention import backends as attn_backends
from wedlm_jax import masking
from wedlm_jax.config import ModelConfig
from wedlm_jax.sharding import make_mesh
from benchmarks import results_file

MODELS = {
    "tiny": dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                 mask_token_id=255, max_position_embeddings=4096),
    # ~100M parameters: 12 layers of width 768 (GQA 12/4 heads), 32k vocabulary, tied embeddings.
    "100m": dict(model_type="qwen3", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                 num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, qk_norm=True,
                 tie_word_embeddings=True, mask_token_id=31999, max_position_embeddings=4096),
}


def _time(fn, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def attention_fn(mc: ModelConfig, rows: int, seq_len: int, block: int, dtype, impl: str,
                 tile: int):
    """A thunk running forward+backward of one layer's attention core as the step runs it (`impl`
    "dense": the [T, T] mask built from the structure; "tiled": the tile plan built from the
    structure, then the tile-skipping kernel) on the step's q/k/v shapes; compiled on first call."""
    t = 2 * seq_len
    k = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(k[0], (rows, t, mc.num_heads, mc.head_dim), dtype)
    kk = jax.random.normal(k[1], (rows, t, mc.num_kv_heads, mc.head_dim), dtype)
    v = jax.random.normal(k[2], (rows, t, mc.num_kv_heads, mc.head_dim), dtype)
    seg = jnp.ones((rows, seq_len), jnp.int32)
    structure = jax.vmap(lambda s: masking.dual_stream_structure(s, block))(seg)

    scale = mc.head_dim ** -0.5

    @jax.jit
    def f(q, kk, v):
        if impl == "dense":
            mask = masking.structure_mask(structure)
            core = lambda q, kk, v: attn_lib.attend(q, kk, v, mask, scale)
        else:
            ctx = attn_backends.make_context(impl, q_struct=structure, k_struct=structure,
                                             batch=rows, tile=tile, template="dual",
                                             block_size=block)
            core = lambda q, kk, v: attn_backends.apply(ctx, q, kk, v, scale)
        loss = lambda q, kk, v: jnp.sum(core(q, kk, v))
        return jax.grad(loss, argnums=(0, 1, 2))(q, kk, v)

    return lambda: f(q, kk, v)


def _bench_config(fields, rows, seq_len, remat, attention, tile):
    """The train config both measurements run (no data is read)."""
    return load_config(None, [
        "model.config=" + json.dumps(fields), "data.train_files=[unused.jsonl]",
        f"data.seq_len={seq_len}", f"data.global_batch_size={rows}", "steps=1000",
        "optimizer.lr=1e-4", "optimizer.final_lr=1e-5", "optimizer.warmup_steps=10",
        "objective.block_size=32", "compute_dtype=f32", f"remat={str(remat).lower()}",
        f"attention={attention}", f"attention_tile={tile}"])


def bench_model(name: str, rows: int, seq_len: int, steps: int, remat: bool, attention: str,
                tile: int, matmul_n: int = 2048) -> dict:
    fields = MODELS[name]
    cfg = _bench_config(fields, rows, seq_len, remat, attention, tile)
    impl = step_lib.attention_impl(cfg)
    mc = ModelConfig(**fields)
    one = _step_thunk(mc, cfg, rows, seq_len)

    t0 = time.perf_counter()
    jax.block_until_ready(one())
    compile_s = time.perf_counter() - t0
    attn = attention_fn(mc, rows, seq_len, 32, jnp.float32, impl, tile)
    jax.block_until_ready(attn())
    flops = step_lib.model_flops_per_row(mc, seq_len, "dual_stream", 32) * rows
    attn_flops = step_lib.attention_flops_per_row(mc, seq_len, "dual_stream", 32) * rows
    # The machine is shared: measure the matmul rate, the step and the attention core back to
    # back, step after step, and take medians of the per-step ratios.
    peaks, times, attn_times = [], [], []
    for _ in range(steps):
        peaks.append(step_lib.measure_matmul_flops(n=matmul_n, repeats=3))
        times += _time(one, 1)
        attn_times += _time(attn, 1)
    step_s = statistics.median(times)
    return {
        "model": name, "attention": impl, "attention_tile": tile, "params": mc.num_params(), "rows": rows, "seq_len": seq_len,
        "fed_slots_per_row": 2 * seq_len, "remat": remat, "compile_and_first_step_s": compile_s,
        "step_times_s": times, "step_s": step_s, "tokens_per_s": rows * seq_len / step_s,
        "model_tflops_per_step": flops / 1e12, "achieved_gflops": flops / step_s / 1e9,
        "f32_matmul_gflops_per_step": [p / 1e9 for p in peaks],
        "mfu": statistics.median(flops / t / p for t, p in zip(times, peaks)),
        "attention_flop_share": attn_flops / flops,
        "attention_layer_fwd_bwd_s": attn_times,
        "attention_time_share": statistics.median(
            mc.num_layers * a / t for a, t in zip(attn_times, times)),
    }


def _step_thunk(mc, cfg, rows, seq_len):
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    opt = step_lib.make_optimizer(cfg)
    sh = step_lib.state_shardings(mc, opt, mesh)
    state = step_lib.init_state(step_lib.init_params_sharded(mc, 0, sh), opt, sh)
    fn = step_lib.make_train_step(cfg, mc, opt, mesh, sh, mc.mask_token_id)
    rng = np.random.default_rng(0)
    bsh = step_lib.batch_shardings(mesh)
    batch = {"tokens": rng.integers(0, mc.vocab_size - 1, (rows, seq_len)).astype(np.int32),
             "segment_ids": np.ones((rows, seq_len), np.int32),
             "maskable": np.ones((rows, seq_len), bool),
             "index": np.arange(rows, dtype=np.int32)}
    batch = {k: jax.device_put(v, bsh[k]) for k, v in batch.items()}
    holder = {"state": state}

    def one():
        holder["state"], m = fn(holder["state"], batch)
        return m["loss"]
    return one


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,100m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up step")
    p.add_argument("--remat", action="store_true")
    p.add_argument("--attention", default="auto", help="dense | tiled | auto (tiled on CPU)")
    p.add_argument("--tile", type=int, default=128, help="attention tile (tiled path)")
    p.add_argument("--matmul-n", type=int, default=2048, help="the f32 matmul timed for the MFU's "
                                                               "peak: n x n x n")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    peak = step_lib.measure_matmul_flops(n=args.matmul_n, repeats=5)
    info = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                       f"jax {jax.__version__} on {jax.devices()[0].platform}",
            "loadavg_at_start": os.getloadavg(), "f32_matmul_gflops": peak / 1e9}
    print(json.dumps(info), flush=True)
    results = []
    for name in args.models.split(","):
        r = bench_model(name, args.rows, args.seq_len, args.steps, args.remat, args.attention,
                        args.tile, args.matmul_n)
        results.append(r)
        print(json.dumps(r), flush=True)
    peak_end = step_lib.measure_matmul_flops(n=args.matmul_n, repeats=5)
    info["f32_matmul_gflops_end"] = peak_end / 1e9
    info["loadavg_at_end"] = os.getloadavg()
    print(json.dumps(info), flush=True)
    out = {"info": info, "results": results}
    return results_file.write(args.out, out)


if __name__ == "__main__":
    main()
