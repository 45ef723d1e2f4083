"""benchmarks/step_bytes.py's reading of an optimized HLO module: top-level instructions only
(not the insides of fusions), operand + result bytes, an in-place update counted as its update."""

from benchmarks.step_bytes import instruction_bytes, source_group

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
