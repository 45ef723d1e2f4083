"""Conversion throughput and peak RSS on a generated ~1 GB Qwen3-shaped float32 checkpoint.

    python -m benchmarks.training.convert [--layers 12] [--hidden 1024] [--vocab 32000] [--keep] [--workdir /tmp]

Writes random tensors straight into 3 safetensors shards + `model.safetensors.index.json` (like a
real HF checkpoint; no transformers involved), then times, each in its own subprocess:
  1. the baseline: `python -c "import wedlm_jax.convert, orbax.checkpoint; jax.devices()"`
     (interpreter + jax/flax/orbax imports + the CPU backend; also a bare `import jax` one),
  2. `wedlm-convert hf-to-orbax --hf HF --out ORBAX`,
  3. `wedlm-convert orbax-to-hf --orbax ORBAX --out HF2`,
  4. `wedlm-convert hf-to-orbax --hf HF --out ORBAX16 --dtype bf16`,
and reads each one's peak RSS with getrusage(RUSAGE_CHILDREN).ru_maxrss in a tiny launcher. The
target is peak RSS <= 1.3 x checkpoint size + baseline. The round trip is checked:
HF2's tensors equal the generated ones (spot-checked with safetensors.numpy). Everything under a
fresh folder in --workdir, deleted at the end unless --keep. Note: the generated files sit in the
page cache, so reads are memory-speed, not disk-speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np


def qwen3_config(layers: int, hidden: int = 1024, vocab: int = 32000) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 128, "head_dim": 128,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "float32"}


def generate(folder: str, cfg: dict, n_shards: int = 3) -> int:
    """Random f32 tensors in HF layout, `n_shards` files + index. Returns total bytes."""
    import safetensors.numpy

    from wedlm_jax import hf_mapping, model
    from wedlm_jax.config import ModelConfig

    config = ModelConfig.from_hf_dict(cfg)
    expected = hf_mapping.expected_tensors(config, model.param_shapes(config))
    names = list(expected)
    sizes = [int(np.prod(expected[n][3])) * 4 for n in names]
    total, per = sum(sizes), sum(sizes) / n_shards
    groups, acc = [[]], 0
    for name, size in zip(names, sizes):
        if acc >= per * len(groups) and len(groups) < n_shards:
            groups.append([])
        groups[-1].append(name)
        acc += size
    rng = np.random.default_rng(0)
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in group:
            shape = expected[n][3]
            tensors[n] = (1.0 if "norm" in n else 0.0) + \
                0.02 * rng.standard_normal(shape, dtype=np.float32)
        safetensors.numpy.save_file(tensors, os.path.join(folder, fname), metadata={"format": "pt"})
        del tensors
        weight_map.update({n: fname for n in group})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return total


# Runs argv[2:] and writes its peak RSS (KiB) to argv[1]. It is a separate small interpreter
# because a child's ru_maxrss starts from its parent's RSS at fork (and survives exec): measured
# straight from this big benchmark process, every child would report at least our own size.
_LAUNCHER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[2:]).returncode; "
             "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN)"
             ".ru_maxrss)); sys.exit(rc)")


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `cmd`, from getrusage(RUSAGE_CHILDREN).ru_maxrss in a
    tiny launcher process whose only child is `cmd`."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as out:
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, "-c", _LAUNCHER, out.name, *cmd]).returncode
        wall = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}")
        return wall, int(out.read()) * 1024  # Linux reports KiB


def dir_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="12 layers ~ 0.98 GB in f32")
    ap.add_argument("--hidden", type=int, default=1024, help="a multiple of 128 (heads of 128)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="wedlm-convert-bench-", dir=args.workdir)
    hf, orbax, hf2, orbax16 = (os.path.join(root, x) for x in ("hf", "orbax", "hf2", "orbax16"))
    os.makedirs(hf)
    py = sys.executable
    cli = [py, "-m", "wedlm_jax.convert"]
    try:
        t0 = time.perf_counter()
        size = generate(hf, qwen3_config(args.layers, args.hidden, args.vocab))
        gen_s = time.perf_counter() - t0
        mb = size / 1e6
        t_bare, bare = run_measured([py, "-c", "import jax; jax.devices()"])
        t_base, base = run_measured([py, "-c", "import jax, orbax.checkpoint, wedlm_jax.convert; "
                                               "jax.devices()"])
        t_h2o, rss_h2o = run_measured(cli + ["hf-to-orbax", "--hf", hf, "--out", orbax,
                                             "--no-progress"])
        t_o2h, rss_o2h = run_measured(cli + ["orbax-to-hf", "--orbax", orbax, "--out", hf2,
                                             "--no-progress"])
        t_h2o16, rss_h2o16 = run_measured(cli + ["hf-to-orbax", "--hf", hf, "--out", orbax16,
                                                 "--dtype", "bf16", "--no-progress"])
        _check_round_trip(hf, hf2)
        target = 1.3 * size + base
        print(f"checkpoint: Qwen3-shaped, {args.layers} layers, f32, 3 shards + index: "
              f"{mb:.0f} MB (generated in {gen_s:.1f} s); orbax folder {dir_bytes(orbax) / 1e6:.0f} MB")
        print(f"baseline: bare `import jax` {bare / 1e6:.0f} MB peak RSS ({t_bare:.1f} s); "
              f"jax+orbax+wedlm_jax.convert imported {base / 1e6:.0f} MB ({t_base:.1f} s)")
        print(f"target peak RSS: 1.3 x {mb:.0f} MB + {base / 1e6:.0f} MB = {target / 1e6:.0f} MB")
        for label, t, rss in (("hf-to-orbax", t_h2o, rss_h2o), ("orbax-to-hf", t_o2h, rss_o2h),
                              ("hf-to-orbax --dtype bf16", t_h2o16, rss_h2o16)):
            print(f"{label}: {t:.1f} s wall = {mb / t:.0f} MB/s; without the {t_base:.1f} s "
                  f"start-up: {mb / (t - t_base):.0f} MB/s; peak RSS {rss / 1e6:.0f} MB = "
                  f"{(rss - base) / size:.2f} x checkpoint + baseline -> "
                  f"{'PASS' if rss <= target else 'FAIL'}")
        print("round trip HF -> Orbax -> HF: all tensors equal")
        return dict(checkpoint_bytes=size, baseline_rss=base, target_rss=target,
                    orbax_bytes=dir_bytes(orbax), orbax_bf16_bytes=dir_bytes(orbax16),
                    hf_round_trip_bytes=dir_bytes(hf2),
                    runs={label: dict(wall_s=t, peak_rss=rss) for label, t, rss in (
                        ("hf-to-orbax", t_h2o, rss_h2o), ("orbax-to-hf", t_o2h, rss_o2h),
                        ("hf-to-orbax --dtype bf16", t_h2o16, rss_h2o16))})
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _check_round_trip(a: str, b: str) -> None:
    from safetensors import safe_open

    from wedlm_jax import safetensors_io as st
    ta, tb = st.index_tensors(a), st.index_tensors(b)
    assert sorted(ta) == sorted(tb), "tensor names differ after the round trip"
    for name in ta:  # one tensor at a time; the safetensors library reads both sides
        with safe_open(ta[name].file, framework="numpy") as fa, \
                safe_open(tb[name].file, framework="numpy") as fb:
            assert np.array_equal(fa.get_tensor(name), fb.get_tensor(name)), name


if __name__ == "__main__":
    main()
