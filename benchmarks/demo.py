"""`make demo`: the main job on a fresh machine, until the trained demo model exists.

What it does, honestly: builds a tiny *random* Qwen3 model with transformers, converts it with
`wedlm-convert hf-to-orbax` (the project's CLI, in a subprocess), loads the Orbax checkpoint, and
prints how closely our jitted JAX forward agrees with transformers' forward on the same inputs, in
natural order and in a reordered (topologically permuted) order with logical positions carried. It
says nothing about generation quality: the weights are random.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def main() -> int:
    import jax

    from tests.hf_models import hf_logits, make_hf_model
    from wedlm_jax.convert import load_checkpoint
    from wedlm_jax.model import Transformer

    print("wedlm-jax demo (placeholder until the trained demo model ships):")
    print("  a tiny RANDOM Qwen3 model -> wedlm-convert hf-to-orbax -> JAX forward vs transformers\n")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_hf_model("qwen3", os.path.join(tmp, "hf"), head_dim=16, hidden=64, layers=4,
                               vocab=256, heads=4, kv_heads=2)
        out_dir = os.path.join(tmp, "orbax")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "wedlm_jax.convert", "hf-to-orbax", "--hf", hf_dir,
                        "--out", out_dir, "--no-progress"], check=True)
        print(f"converted {hf_dir} -> {out_dir} in {time.perf_counter() - t0:.1f}s (subprocess)")
        config, params = load_checkpoint(out_dir)
        print(f"model: {config.model_type}, {config.num_params():,} parameters, "
              f"{config.num_layers} layers, head_dim {config.head_dim}, qk_norm={config.qk_norm}")
        forward = jax.jit(Transformer(config).apply)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, config.vocab_size, (2, 24))
        positions = np.broadcast_to(np.arange(24), (2, 24))
        perm = np.stack([rng.permutation(24) for _ in range(2)])
        print(f"\n{'input order':<34}{'max |logit diff|':>18}{'max |logit|':>14}")
        for name, (t, p) in {"natural": (tokens, positions),
                             "permuted (positions carried)": (np.take_along_axis(tokens, perm, 1),
                                                              np.take_along_axis(positions, perm, 1))}.items():
            ours = np.asarray(forward({"params": params}, t, p))
            ref = hf_logits(hf_dir, t, p)
            print(f"{name:<34}{np.abs(ours - ref).max():>18.2e}{np.abs(ref).max():>14.3f}")
        print("\nfloat32 on CPU; agreement within 1e-4 is what tests/test_parity.py asserts.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
