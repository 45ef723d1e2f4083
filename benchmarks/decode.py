"""Decoding engine measurements (issue 4 "Measured"). One run, random weights, this machine.

    python -m benchmarks.decode [--quick] [--json out.json]

1. Engine overhead: time per streaming step vs one jitted forward of W slots on the same cache.
   Step time = (wall(max_new=L) - wall(max_new=S)) / (iterations difference): prefill and fixed
   costs cancel (max_new_tokens is a runtime value: same compiled program). Forward time: a jitted
   fori_loop of K cache-mode forwards of W slots (logits consumed, so the LM head is not dropped)
   at the mid-run cache length, divided by K.
2. Scaling: time per generated token at capacity 8192 vs 512, same prompt and length.
3. Our AR vs transformers' `generate` (torch, CPU, greedy) on the same tiny model, 256 new tokens,
   batch 1 and 8.
4. Tokens per forward, p_cache and wall-clock ratios streaming/AR and streaming/block on a random
   model (mechanics only: a random model's predictions are not text).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from decode.config import DecodeConfig
from decode.engine import DEFAULT_KV_TILE, generate
from wedlm_jax.config import ModelConfig
from wedlm_jax.model import Transformer, init_kv_cache, param_shapes

SMALL = ModelConfig(model_type="qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768,
                    num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True,
                    mask_token_id=2047)
TINY = dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16)


def random_params(config, seed=0, head_scale=1.0):
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return (1.0 + 0.1 * rng.standard_normal(s.shape)).astype(np.float32)
        w = 0.02 * rng.standard_normal(s.shape)
        return (w * head_scale if "lm_head" in name else w).astype(np.float32)
    return jax.tree.map(jnp.asarray, jax.tree_util.tree_map_with_path(leaf, param_shapes(config)))


def best_of(fn, repeats):
    """Run fn() `repeats` times, return (median seconds, last result)."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def forward_loop_time(params, config, window, start, advance, capacity_rows, k, repeats,
                      tile=DEFAULT_KV_TILE):
    """Seconds per cache-mode forward of `window` slots; forward i reads a cache of length
    start + i * advance (the engine's committed length grows like that)."""
    model = Transformer(config)
    toks = jnp.full((1, window), config.mask_token_id, jnp.int32)

    @jax.jit
    def loop(params, cache):
        def body(i, carry):
            cache, acc = carry
            n = (start + (i * advance).astype(jnp.int32)).astype(jnp.int32)
            cl = jnp.full((1,), n, jnp.int32)
            pos = n + jnp.arange(window, dtype=jnp.int32)[None]
            logits, cache = model.apply({"params": params}, toks, pos, kv_cache=cache, cache_len=cl,
                                        kv_tile=tile)
            return cache, acc + jnp.max(logits)
        return jax.lax.fori_loop(0, k, body, (cache, jnp.float32(0)))

    cache = init_kv_cache(config, 1, capacity_rows)
    jax.block_until_ready(loop(params, cache))   # compile + warm

    def run():
        return jax.block_until_ready(loop(params, cache))
    t, _ = best_of(run, repeats)
    return t / k


def engine_step_time(params, config, dc, prompt, capacity, short, long, repeats):
    """(seconds per loop iteration excluding prefill, results at `long`)."""
    def timed(n):
        r = generate(params, config, [prompt], dc.replace(max_new_tokens=n), capacity=capacity)
        return r
    generate(params, config, [prompt], dc.replace(max_new_tokens=short), capacity=capacity)  # compile
    ts_runs = [timed(short) for _ in range(repeats)]
    ts, rs = statistics.median(r.wall_s for r in ts_runs), ts_runs[-1]
    tl_runs = [timed(long) for _ in range(repeats)]
    tl = statistics.median(r.wall_s for r in tl_runs)
    rl = tl_runs[-1]
    return (tl - ts) / (rl.loop_iterations - rs.loop_iterations), rl, ts, tl


def section_overhead(out, repeats, quick):
    params = random_params(SMALL, 0, head_scale=20.0)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 2000, 64).tolist()
    w = 16
    dc = DecodeConfig(method="streaming", window=w, tau=2.0, lam=0.05)
    short, long = (16, 64) if quick else (32, 256)
    step, res, ts, tl = engine_step_time(params, SMALL, dc, prompt, 512, short, long, repeats)
    rows = 512 + 64   # the engine's cache rows for capacity 512, W 16
    k = res.loop_iterations
    fwd = forward_loop_time(params, SMALL, w, 64, jnp.float32(res.n_gen / k), rows, k, repeats)
    out["overhead"] = dict(model="hidden 256, 4 layers, 8/4 heads, head_dim 32, vocab 2048",
                           window=w, capacity=512, prompt=64, step_s=step, forward_s=fwd,
                           ratio=step / fwd, iterations_long=res.loop_iterations,
                           wall_short_s=ts, wall_long_s=tl, n_gen=res.n_gen)


def section_scaling(out, repeats, quick):
    params = random_params(SMALL, 0, head_scale=20.0)
    prompt = np.random.default_rng(2).integers(0, 2000, 64).tolist()
    new = 64 if quick else 256
    res = {}
    for method in ("streaming", "ar"):
        dc = DecodeConfig(method=method, window=16, tau=2.0, lam=0.05, max_new_tokens=new)
        for cap in (512, 8192):
            generate(params, SMALL, [prompt], dc, capacity=cap)   # compile
            runs = [generate(params, SMALL, [prompt], dc, capacity=cap) for _ in range(repeats)]
            wall = statistics.median(r.wall_s for r in runs)
            res[f"{method}_{cap}"] = dict(s_per_token=wall / runs[-1].n_gen, n_gen=runs[-1].n_gen,
                                          tokens=runs[-1].tokens[0][:8])
        res[f"{method}_ratio"] = res[f"{method}_8192"]["s_per_token"] / res[f"{method}_512"]["s_per_token"]
        assert res[f"{method}_8192"]["tokens"] == res[f"{method}_512"]["tokens"]
    out["scaling"] = res


def section_vs_transformers(out, repeats, quick):
    import torch
    from transformers import AutoModelForCausalLM
    from tests.hf_models import make_hf_model
    from wedlm_jax.convert import load_hf_checkpoint

    new = 64 if quick else 256
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_hf_model("qwen3", os.path.join(tmp, "hf"), seed=0, **TINY)
        config, params = load_hf_checkpoint(path, progress=False)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        for batch in (1, 8):
            prompts = np.random.default_rng(3).integers(0, TINY["vocab"], (batch, 16))
            dc = DecodeConfig(method="ar", max_new_tokens=new)
            generate(params, config, prompts.tolist(), dc)   # compile
            ours_runs = [generate(params, config, prompts.tolist(), dc) for _ in range(repeats)]
            ours = statistics.median(r.wall_s for r in ours_runs)

            def hf_run():
                with torch.no_grad():
                    ids = torch.as_tensor(prompts)
                    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                       min_new_tokens=new, do_sample=False, pad_token_id=0,
                                       eos_token_id=None)
            hf_run()
            t_hf, hf_out = best_of(hf_run, repeats)
            same = hf_out[:, 16:].tolist() == ours_runs[-1].tokens
            res[f"batch{batch}"] = dict(ours_s=ours, transformers_s=t_hf, speedup=t_hf / ours,
                                        ours_tokens_per_s=batch * new / ours,
                                        transformers_tokens_per_s=batch * new / t_hf,
                                        same_tokens=same)
    res["model"] = "qwen3 " + ", ".join(f"{k} {v}" for k, v in TINY.items())
    res["torch_threads"] = torch.get_num_threads()
    out["vs_transformers"] = res


def section_methods(out, repeats, quick):
    params = random_params(SMALL, 0, head_scale=20.0)
    prompt = np.random.default_rng(4).integers(0, 2000, 64).tolist()
    new = 64 if quick else 256
    res = {}
    for tau in (0.4, 2.0):
        row = {}
        for method in ("streaming", "block", "ar"):
            dc = DecodeConfig(method=method, window=16, tau=tau, lam=0.05, max_new_tokens=new)
            generate(params, SMALL, [prompt], dc, capacity=512)   # compile
            runs = [generate(params, SMALL, [prompt], dc, capacity=512) for _ in range(repeats)]
            r = runs[-1]
            row[method] = dict(wall_s=statistics.median(x.wall_s for x in runs), steps=r.steps,
                               n_gen=r.n_gen, n_fwd=r.n_fwd, tokens_per_forward=r.tokens_per_forward,
                               p_cache=r.p_cache)
        row["streaming_over_ar"] = row["streaming"]["wall_s"] / row["ar"]["wall_s"]
        row["streaming_over_block"] = row["streaming"]["wall_s"] / row["block"]["wall_s"]
        res[f"tau{tau}"] = row
    out["methods"] = res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test of the script)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--only", default=None, help="comma list: overhead,scaling,transformers,methods")
    args = ap.parse_args(argv)
    out = dict(machine=f"{platform.machine()} {os.cpu_count()} CPU cores, jax {jax.__version__} "
                       f"{jax.devices()[0].platform}", quick=args.quick)
    sections = dict(overhead=section_overhead, scaling=section_scaling,
                    transformers=section_vs_transformers, methods=section_methods)
    chosen = args.only.split(",") if args.only else list(sections)
    for name in chosen:
        t0 = time.perf_counter()
        sections[name](out, args.repeats, args.quick)
        print(f"# {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        print(json.dumps({k: v for k, v in out.items() if k in (name, "overhead", "scaling", "vs_transformers", "methods") and k.startswith(name[:5])}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
