"""Quantized weights in the decode step compiled for a v5p by libtpu (no TPU needed), bytes
read from the compiled program with benchmarks/compiled/step_bytes.py: per-channel int8 and int4 kernels
are read as they are stored; grouped int4 kernels through the Mosaic kernel
(wedlm_jax/grouped_matmul.py). The H100's twin: benchmarks/tests/test_quantize_gpu.py. Needs
.venv/tpu-compiler (`make setup`)."""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TPU_BYTES = """
import json
from jax.experimental import topologies
from benchmarks.compiled.step_bytes import hbm_traffic
from decode.compile import aot
from decode.config import EngineOptions, Placement
from wedlm_jax.config import ModelConfig
dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:1x1x1",
                                   chips_per_host_bounds=(1, 1, 1)).devices[0]
config = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=1024, intermediate_size=4096,
                     num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=True)
out = {}
for scheme, group in (("none", None), ("int8", None), ("int4", 0), ("int4", 64)):
    dec, compiled = aot.generate_program(
        config, [dev], EngineOptions(method="ar", slots=8, capacity=1024),
        Placement(dtype="bfloat16", attention="tiled", page_size=0, quantize=scheme,
                  quantize_group=group), scan_unroll=config.num_layers)
    text = compiled.as_text()
    out[f"{scheme} {group}"] = dict(bytes=hbm_traffic(text), stacked=dec.static.stacked_layers,
                                    kernels=sum("custom-call(" in l and "wedlm_grouped_matmul"
                                                in l.split("=")[0] for l in text.splitlines()))
print("RESULT " + json.dumps(out))
"""


def test_quantized_kernels_are_read_as_stored_on_a_tpu():
    """Compiled by libtpu for a v5p chip (a toy AR step, whole depth; bytes from the program's
    instructions, the Mosaic kernel's operands and result included): int8 and per-channel int4
    kernels enter the projections' own einsums and are read in place (in the GPU's 2-D gemm form
    libtpu copied q_proj and o_proj into another layout at every step: the 8B moved 0.654x /
    0.432x of bf16's bytes, 0.588x / 0.399x now); int4 in groups of 64 goes through the Mosaic
    kernel, one call per projection and layer, over one weight tree per layer, q / k / v's heads
    read as laid out (libtpu dequantizes a grouped kernel into a bf16 copy: 1.95x the bf16 step
    on the 8B)."""
    import subprocess
    import sys

    from tests import tpu_compiler
    proc = subprocess.run([sys.executable, "-c", TPU_BYTES], env=tpu_compiler.env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    ratio = {k: round(v["bytes"] / out["none None"]["bytes"], 3) for k, v in out.items()}
    print("v5p compile, toy AR step, bytes against bf16 weights:", ratio)
    assert ratio["int8 None"] < 0.63 and ratio["int4 0"] < 0.42, ratio
    assert out["int4 64"]["kernels"] == 7 * 2 and not out["int4 64"]["stacked"], out
    assert out["int4 0"]["kernels"] == 0 and out["int4 0"]["stacked"], out
    assert ratio["int4 64"] < 0.44, ratio            # 0.467 with q / k / v flattened (a copy)
