"""The decode step compiled for an H100 by XLA's GPU compiler, no GPU needed (issue 21): with its
weights as one buffer per layer (decode/layouts.py) the step moves about half the bytes it moves
with them stacked, where XLA:GPU copies each layer's weights out of the stack at every step.

Needs XLA's GPU compiler, which `make setup` installs into .venv/gpu-compiler (`make
gpu-compiler` alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests import xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_COMPILER = os.path.join(ROOT, ".venv", "gpu-compiler")

SCRIPT = textwrap.dedent("""
    import json
    from benchmarks.step_bytes import hbm_traffic
    from decode import aot, layouts
    from wedlm_jax.config import ModelConfig
    from wedlm_jax.targets import describe_target
    config = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=1024, intermediate_size=4096,
                         num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=True)
    dev = describe_target("h100")[0][0]
    out = {}
    for stacked in (True, False):
        layouts.layers_stacked = lambda platform, s=stacked: s
        dec, compiled = aot.generate_program(config, [dev], method="ar", slots=4, capacity=256,
                                             dtype="bfloat16", attention="auto", page_size=16,
                                             scan_unroll=config.num_layers)   # every layer counted
        out[str(stacked)] = dict(bytes=hbm_traffic(compiled.as_text()),
                                 flat="layer_0" in dec.params, platform=dev.platform)
    print("RESULT " + json.dumps(out))
""")


def test_per_layer_weights_halve_the_gpu_decode_steps_bytes():
    assert os.path.isdir(os.path.join(GPU_COMPILER, "jax_plugins")), (
        f"XLA's GPU compiler is not in {GPU_COMPILER}: run `make setup` (or `make gpu-compiler`)")
    env = dict(xla.full_compile(os.environ), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, GPU_COMPILER]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    stacked, flat = out["True"], out["False"]
    assert flat["flat"] and not stacked["flat"]
    weights = 2 * 2 * (3 * 1024 * 4096 + 1024 * (8 + 2 + 2) * 128 + 8 * 128 * 1024)   # bf16, 2 layers
    assert stacked["bytes"] - flat["bytes"] > weights, out      # the copies: more than the weights
    assert flat["bytes"] < stacked["bytes"] / 1.8, out
