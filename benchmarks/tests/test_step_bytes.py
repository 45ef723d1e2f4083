"""benchmarks/compiled/step_bytes.py's reading of an optimized HLO module: top-level instructions only
(not the insides of fusions), operand + result bytes, an in-place update counted as its update;
the paged kernel's bytes the compiler does not count; the program itself for a TPU (libtpu) at one
layer of the 8B; and with it, the GPU decode step's bytes with its weights per layer or stacked
(XLA's GPU compiler, no GPU: .venv/gpu-compiler, `make setup`)."""

import os
import re
import subprocess
import sys
import textwrap

from benchmarks.compiled.step_bytes import instruction_bytes, kernel_not_counted, source_group
from tests import tpu_compiler
from tests.gpu_compiler import run_for_the_gpu
from wedlm_jax.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HLO = """HloModule m, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}

%fused_computation (p0: f32[8,16]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  ROOT %e = f32[8,16]{1,0} exponential(f32[8,16]{1,0} %p0)
}

ENTRY %main (a: f32[8,16], b: bf16[64,16], u: bf16[2,16]) -> (f32[8,16], bf16[64,16]) {
  %a = f32[8,16]{1,0} parameter(0)
  %b = bf16[64,16]{1,0:T(8,128)(2,1)} parameter(1)
  %u = bf16[2,16]{1,0} parameter(2)
  %f = f32[8,16]{1,0} fusion(f32[8,16]{1,0} %a), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/while/body/exp"}
  %c = f32[8,16]{1,0} copy(f32[8,16]{1,0} %f), metadata={op_name="jit(step)/transpose"}
  %d = bf16[64,16]{1,0} dynamic-update-slice(bf16[64,16]{1,0:T(8,128)(2,1)} %b, bf16[2,16]{1,0} %u, s32[] %i, s32[] %j)
  ROOT %t = (f32[8,16]{1,0}, bf16[64,16]{1,0}) tuple(f32[8,16]{1,0} %c, bf16[64,16]{1,0} %d)
}
"""


def test_top_level_instructions_with_their_bytes():
    rows = {r["name"]: r for r in instruction_bytes(HLO)}
    assert set(rows) == {"f", "c", "d"}            # parameters, tuples and fused insides skipped
    assert rows["f"]["bytes"] == 2 * 8 * 16 * 4 and rows["f"]["op"] == "fusion"
    assert rows["c"]["bytes"] == 2 * 8 * 16 * 4
    assert rows["d"]["bytes"] == 2 * (2 * 16 * 2 + 2 * 4)   # the update (and indices) in and out
    assert source_group(rows["f"]["source"]) == "exp"
    assert [r["name"] for r in instruction_bytes(HLO)][:2] in (["f", "c"], ["c", "f"])


def test_operands_named_without_shapes_are_sized_by_their_producer():
    hlo = HLO.replace("copy(f32[8,16]{1,0} %f)", "copy(%f)").replace(
        "fusion(f32[8,16]{1,0} %a)", "fusion(%a, %u)")
    rows = {r["name"]: r for r in instruction_bytes(hlo)}
    assert rows["c"]["bytes"] == 2 * 8 * 16 * 4
    assert rows["f"]["bytes"] == 2 * 8 * 16 * 4 + 2 * 16 * 2


def test_memory_spaces_counted_apart_and_async_copies_once():
    """A weight prefetched into VMEM (S(1)) by copy-start / copy-done: HBM is read once by the
    copy; the fusion reading the VMEM copy adds no HBM bytes."""
    hlo = """HloModule m

ENTRY %main (w: bf16[64,128], x: f32[8,64]) -> f32[8,128] {
  %w = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
  %x = f32[8,64]{1,0} parameter(1)
  %cs = (bf16[64,128]{1,0:T(8,128)(2,1)S(1)}, bf16[64,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(bf16[64,128]{1,0:T(8,128)(2,1)} %w)
  %cd = bf16[64,128]{1,0:T(8,128)(2,1)S(1)} copy-done((bf16[64,128]{1,0:T(8,128)(2,1)S(1)}, bf16[64,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) %cs)
  ROOT %f = f32[8,128]{1,0} fusion(f32[8,64]{1,0} %x, bf16[64,128]{1,0:T(8,128)(2,1)S(1)} %cd), kind=kOutput, calls=%dot
}
"""
    rows = {r["name"]: r for r in instruction_bytes(hlo)}
    w = 64 * 128 * 2
    assert rows["cs"]["bytes"] == 2 * w and rows["cs"]["hbm_bytes"] == w     # HBM in, VMEM out
    assert rows["cd"]["bytes"] == 0
    assert rows["f"]["hbm_bytes"] == 8 * 64 * 4 + 8 * 128 * 4               # x in, result out
    assert rows["f"]["bytes"] == rows["f"]["hbm_bytes"] + w                  # + the VMEM read


def test_a_gather_reads_the_rows_it_produces():
    hlo = """HloModule m

ENTRY %main (t: bf16[1000,64], i: s32[8]) -> bf16[8,64] {
  %t = bf16[1000,64]{1,0} parameter(0)
  %i = s32[8]{0} parameter(1)
  ROOT %g = bf16[8,64]{1,0} fusion(bf16[1000,64]{1,0} %t, s32[8]{0} %i), kind=kLoop, calls=%gf, metadata={op_name="jit(step)/Transformer/gather"}
}
"""
    (row,) = instruction_bytes(hlo)
    assert row["bytes"] == row["hbm_bytes"] == 2 * 8 * 64 * 2 + 8 * 4    # rows in + out, indices


def test_a_fusion_slicing_a_stacked_weight_reads_one_layer():
    hlo = """HloModule m

%fc (p0: bf16[36,64,128], p1: f32[8,64], p2: s32[]) -> f32[8,128] {
  %p0 = bf16[36,64,128]{2,1,0} parameter(0)
  %p1 = f32[8,64]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(bf16[36,64,128]{2,1,0} %p0, s32[] %p2, s32[] %z, s32[] %z), dynamic_slice_sizes={1,64,128}
  ROOT %d = f32[8,128]{1,0} dot(%p1, %ds)
}

ENTRY %main (w: bf16[36,64,128], x: f32[8,64], l: s32[]) -> f32[8,128] {
  %w = bf16[36,64,128]{2,1,0} parameter(0)
  %x = f32[8,64]{1,0} parameter(1)
  %l = s32[] parameter(2)
  ROOT %f = f32[8,128]{1,0} fusion(bf16[36,64,128]{2,1,0} %w, f32[8,64]{1,0} %x, s32[] %l), kind=kOutput, calls=%fc
}
"""
    (row,) = instruction_bytes(hlo)
    assert row["hbm_bytes"] == 64 * 128 * 2 + 8 * 64 * 4 + 4 + 8 * 128 * 4   # one layer's slice


def test_the_paged_kernels_uncounted_bytes_are_live_kv_queries_and_output():
    c = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    kv = 3 * 100 * 2 * 2 * 2 * 8 * 2        # slots x live rows x (K, V) x layers x kv heads x d x bf16
    q_out = 2 * 2 * 3 * 16 * 4 * 8 * 2      # (q, out) x layers x slots x span x heads x d x bf16
    assert kernel_not_counted(3, 16, c, 100, "bfloat16") == kv + q_out
    assert kernel_not_counted(3, 16, c, 100, "float32") == 2 * (kv + q_out)


def test_one_layer_of_the_8b_paged_step_for_a_v5p():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compiled.step_bytes", "--layers", "1",
                           "--method", "streaming", "--window", "8", "--page-size", "64",
                           "--top", "2"], env=tpu_compiler.env(), capture_output=True, text=True,
                          timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert out.startswith("streaming W 8 (compiler weight layout), 1 layers"), out
    ratio = float(re.search(r"GB = ([\d.]+) of the floor", out).group(1))
    assert "the paged-attention kernels' live pages" in out and 0.95 < ratio < 1.5, out
    assert "top 2 instructions" in out and "by source op" in out


GPU_LAYERS = textwrap.dedent("""
    import json
    from benchmarks.compiled.step_bytes import hbm_traffic
    from decode.compile import aot
    from decode.config import EngineOptions, Placement
    from decode.engine.planning import layouts
    from wedlm_jax.config import ModelConfig
    from wedlm_jax.runtime.targets import describe_target
    config = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=1024, intermediate_size=4096,
                         num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=True)
    dev = describe_target("h100")[0][0]
    out = {}
    for stacked in (True, False):
        layouts.layers_stacked = lambda platform, grouped_kernel=False, s=stacked: s
        dec, compiled = aot.generate_program(   # the layers unrolled: every layer counted
            config, [dev], EngineOptions(method="ar", slots=4, capacity=256),
            Placement(dtype="bfloat16", attention="auto", page_size=16),
            scan_unroll=config.num_layers)
        out[str(stacked)] = dict(bytes=hbm_traffic(compiled.as_text()),
                                 flat="layer_0" in dec.params, platform=dev.platform)
    print("RESULT " + json.dumps(out))
""")


def test_per_layer_weights_halve_the_gpu_decode_steps_bytes():
    """The decode step compiled for an H100: with its weights as one buffer per layer
    (decode/engine/planning/layouts.py) it moves about half the bytes it moves with them stacked, where XLA:GPU
    copies each layer's weights out of the stack at every step."""
    out = run_for_the_gpu(GPU_LAYERS)
    stacked, flat = out["True"], out["False"]
    assert flat["flat"] and not stacked["flat"]
    weights = 2 * 2 * (3 * 1024 * 4096 + 1024 * (8 + 2 + 2) * 128 + 8 * 128 * 1024)   # bf16, 2 layers
    assert stacked["bytes"] - flat["bytes"] > weights, out      # the copies: more than the weights
    assert flat["bytes"] < stacked["bytes"] / 1.8, out
