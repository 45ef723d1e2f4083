"""Quantized weights in the decode step compiled for an H100 by XLA's GPU compiler (no GPU
needed): per-channel int8 and int4 kernels are read as they are stored (the cast fused into each
projection's gemm: the step moves about their bytes, not a dequantized float copy's), with the
weights in the compiler's layouts and the q / k / v dots left unmerged (decode/engine/planning/layouts.py);
grouped int4 kernels through the Pallas kernel (wedlm_jax/grouped_matmul.py).
The 8B figures: BENCHMARKS.md section 11. Needs .venv/gpu-compiler (`make setup`)."""

from __future__ import annotations

import textwrap

from tests.gpu_compiler import run_for_the_gpu

SCRIPT = textwrap.dedent("""
    import json
    from benchmarks.compiled.step_bytes import hbm_traffic
    from decode.compile import aot
    from decode.config import EngineOptions, Placement
    from wedlm_jax.config import ModelConfig
    from wedlm_jax.runtime.targets import describe_target
    config = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=1024,
                         intermediate_size=4096, num_layers=2, num_heads=8, num_kv_heads=2,
                         head_dim=128, qk_norm=True)
    dev = describe_target("h100")[0][0]
    out = {}
    for scheme, group in (("none", None), ("int8", None), ("int4", 0), ("int4", 64)):
        dec, compiled = aot.generate_program(
            config, [dev], EngineOptions(method="ar", window=1, slots=8, capacity=128),
            Placement(dtype="bfloat16", attention="auto", page_size=0, quantize=scheme,
                      quantize_group=group))
        text = compiled.as_text()
        out[f"{scheme} {group}"] = dict(bytes=hbm_traffic(text), layout=dec.weight_layout,
                                        kernels=text.count('name = \\"wedlm_grouped_matmul'))
    print("RESULT " + json.dumps(out))
""")


def test_per_channel_kernels_are_read_as_stored_on_the_gpu():
    out = run_for_the_gpu(SCRIPT)
    config_layers = 2
    bf16 = out["none None"]["bytes"]
    ratio = {k: round(v["bytes"] / bf16, 3) for k, v in out.items()}
    print("H100 compile, toy AR step, bytes against bf16 weights:", ratio)
    assert out["int8 None"]["layout"] == "compiler" and out["none None"]["layout"] == "default"
    assert ratio["int8 None"] < 0.6, ratio            # the projections are most of the bytes
    assert ratio["int4 0"] < 0.4, ratio
    # grouped int4 through the Pallas kernel (XLA:GPU does not fuse a sub-channel
    # dequantization: 2.1x the bf16 step without it); one call per projection and layer
    assert out["int4 64"]["kernels"] == 7 * config_layers and out["int4 0"]["kernels"] == 0
    assert ratio["int4 64"] < 0.45, ratio
