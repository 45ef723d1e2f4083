"""The weights in the layouts the compiled decode step picks (decode/engine/planning/layouts.py): the
same tokens as row-major weights under random arrival (every method) and in a static batch, the
weights really placed in the compiled program's formats, one `generate` program, and the choice
checked where it is made (Decoder, Placement, the doors' flag)."""

from __future__ import annotations

import random
import subprocess
import sys

import jax
import pytest

from tests import plans
from decode.engine.planning import layouts
from decode.engine.runtime.batcher import Batcher
from decode.config import DecodeConfigError, Placement
from decode.engine.step.state import Request
from tests.synthetic import random_params
from wedlm_jax.config import ModelConfig

CONFIG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     mask_token_id=63)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, seed=4, head_scale=20.0)


def _decoder(params, method, layout, **kw):
    return plans.decoder(params, CONFIG, method=method, window=4, slots=3, capacity=64,
                   steps_per_call=3, kv_tile=16, weight_layout=layout, **kw)


def _arrivals(decoder, n=9, seed=0):
    rng = random.Random(seed)
    reqs = [Request(prompt=tuple(rng.randrange(1, 60) for _ in range(rng.randrange(2, 20))),
                    max_new_tokens=rng.randrange(3, 16), tau=rng.choice([0.0, 0.5]),
                    temperature=rng.choice([0.0, 0.8]), seed=i) for i in range(n)]
    b, out, todo = Batcher(decoder), {}, list(enumerate(reqs))
    while todo or b.num_active or b.num_waiting:
        for _ in range(rng.randrange(0, 3)):
            if todo:
                i, r = todo.pop(0)
                b.submit(r, on_finish=lambda f, i=i: out.__setitem__(i, f))
        b.step()
    return [out[i].tokens for i in range(n)]


@pytest.mark.parametrize("method", ["streaming", "ar", "verified"])
def test_compiler_layouts_give_the_tokens_of_row_major_weights(params, method):
    default = _decoder(params, method, "default")
    chosen = _decoder(params, method, "compiler")
    assert default.weight_layout == "default" and default.compiled_generate is None
    assert chosen.weight_layout == "compiler" and chosen.compiled_generate is not None
    assert _arrivals(chosen) == _arrivals(default)


def test_the_weights_sit_in_the_compiled_programs_formats(params):
    dec = _decoder(params, "streaming", "compiler")
    formats = dec.compiled_generate.input_formats[0][0]
    placed = jax.tree.leaves(jax.tree.map(lambda x, f: x.format == f, dec.params, formats))
    assert placed and all(placed)
    # the static batch (prefill_into, then the kept generate program) agrees with row-major weights
    reqs = [Request(prompt=(5, 6, 7, 8), max_new_tokens=9), Request(prompt=(9,) * 11, max_new_tokens=5)]
    outs = []
    for d in (dec, _decoder(params, "streaming", "default")):
        state, toks = d.start(reqs), [[], []]
        while True:
            state, res = d.generate(state)
            for i in range(2):
                toks[i] += res.new_ids(i)
            if res.done.all():
                break
        outs.append(toks)
    assert outs[0] == outs[1] and all(outs[0])


def test_the_choice_is_resolved_per_platform_and_checked():
    assert layouts.resolve("auto", "tpu") == "compiler"
    assert layouts.resolve("auto", "cpu") == "default"
    assert layouts.resolve("auto", "gpu") == "default"
    assert layouts.resolve("auto", "gpu", quantized=True) == "compiler"   # the int4 gemm's order
    assert layouts.resolve("auto", "cpu", quantized=True) == "default"
    assert layouts.resolve("default", "tpu") == "default"
    with pytest.raises(DecodeConfigError, match="weight_layout 'rowmajor' is unknown; allowed: "
                                                "auto, compiler, default") as e:
        plans.decoder(random_params(CONFIG, seed=0), CONFIG, method="ar", capacity=32,
                weight_layout="rowmajor")
    assert e.value.field == "weight_layout"
    with pytest.raises(DecodeConfigError, match="allowed: auto, compiler, default"):
        Placement(weight_layout="tiled")


class _Device:
    def __init__(self, platform, kind):
        self.platform, self.device_kind = platform, kind


def test_the_step_options_are_the_tpu_generations_with_the_callers_over_them():
    """`layouts.step_options`: the table's options for the device's TPU generation (as libtpu names
    the chips, real or compile-only), none elsewhere; a caller's options over them, a key given
    as None left to the compiler."""
    vmem = "xla_tpu_scoped_vmem_limit_kib"
    v5p, v5e = _Device("tpu", "TPU v5"), _Device("tpu", "TPU v5 lite")
    assert layouts.step_options(v5p) == {vmem: 65536}
    assert layouts.step_options(v5e) is None
    assert layouts.step_options(_Device("cpu", "cpu")) is None
    assert layouts.step_options(_Device("gpu", "NVIDIA H100 80GB HBM3")) is None
    assert layouts.step_options(v5p, {vmem: None}) is None
    assert layouts.step_options(v5p, {vmem: 32768, "x": 1}) == {vmem: 32768, "x": 1}
    assert layouts.step_options(v5e, {"x": 1}) == {"x": 1}
    h100 = _Device("gpu", "NVIDIA H100 80GB HBM3")        # quantized weights: no q/k/v dot merge
    assert layouts.step_options(h100, quantized=True) == layouts.QUANTIZED_GPU_OPTIONS
    assert layouts.step_options(v5p, quantized=True) == {vmem: 65536}


def test_the_doors_flag_refuses_an_unknown_layout_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "decode.cli", "--checkpoint", str(tmp_path), "--prompt", "x",
                           "--weight-layout", "rowmajor"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "--weight-layout: invalid choice: 'rowmajor'" in proc.stderr
    assert "Traceback" not in proc.stderr
