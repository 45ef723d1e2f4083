"""The grouped matmul kernels (wedlm_jax/grouped_matmul.py: Triton and Mosaic) in Pallas interpret
mode against the dequantized kernel's matmul, the matmul forms a model reads quantized kernels in
(quantize.matmul_form), and the plan's choice of kernel. Their compiles (the bytes the step
moves): benchmarks/tests/test_quantize_gpu.py (H100), benchmarks/tests/test_quantize_tpu.py (v5p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from tests.plans import plan
from wedlm_jax import grouped_matmul as gm
from wedlm_jax import model as model_lib
from wedlm_jax import quantize as q
from wedlm_jax.config import ModelConfig

CONFIG = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=128, intermediate_size=256,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                     mask_token_id=255)


def _kernel(k: int, n: int, scheme: str, group: int, seed: int = 0):
    w = jnp.asarray(np.random.default_rng(seed).standard_normal((k, n)) * 0.05, jnp.float32)
    return q.quantize_kernel(w, scheme, 1, group)


@pytest.mark.parametrize("which,m,k,n,scheme,group,splits", [
    ("triton", 1, 128, 64, "int4", 64, None),       # one row (a lone AR step)
    ("triton", 8, 256, 128, "int4", 64, None),      # a decode step's rows: the input axis split
    ("triton", 8, 256, 128, "int4", 64, 1),         # ... unsplit
    ("triton", 40, 512, 192, "int4", 32, 2),        # rows not a power of two; 3 column blocks
    ("triton", 130, 256, 64, "int8", 16, None),     # more rows than one block holds
    ("mosaic", 8, 2048, 1024, "int4", 64, None),    # 2 input blocks of 1024, 2 column blocks
    ("mosaic", 5, 2048, 384, "int4", 64, None),     # column blocks of 128
    ("mosaic", 3, 384, 256, "int8", 64, None),      # the input axis one block (6 scale rows)
    ("mosaic", 130, 512, 128, "int4", 32, None),    # groups of 32, 16 scale rows a block
])
def test_kernel_equals_the_dequantized_matmul(which, m, k, n, scheme, group, splits):
    kernel = _kernel(k, n, scheme, group)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = x @ qwix.dequantize(kernel)
        out = gm.grouped_matmul(x, kernel.qvalue, kernel.scale, group=group, kernel=which,
                                interpret=True, splits=splits)
    assert out.shape == (m, n) and out.dtype == x.dtype
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("m,k,heads,group", [(5, 1024, 16, 64), (3, 512, 2, 32)])
def test_mosaic_kernel_reads_a_projections_heads_as_laid_out(m, k, heads, group):
    """Values [K, H, D] (q / k / v) into an output [M, H, D]: 8 heads a block (or all), the
    input axis in blocks of whole groups."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((k, heads, 128)) * 0.05, jnp.float32)
    kernel = q.quantize_kernel(w, "int4", 1, group)
    assert gm.mosaic_heads(k, heads, 128, group) == (k if k < 1024 else 1024, min(heads, 8))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = jnp.einsum("mk,khd->mhd", x, qwix.dequantize(kernel))
        out = gm.grouped_matmul(x, kernel.qvalue, kernel.scale, group=group, kernel="mosaic",
                                interpret=True)
    assert out.shape == (m, heads, 128)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 * float(jnp.abs(ref).max()))
    assert gm.mosaic_heads(k, heads, 64, group) is None          # head_dim under the lanes
    assert gm.mosaic_heads(k, 12, 128, group) is None            # 12 heads: no block of 8


def test_kernel_in_bfloat16_within_its_rounding():
    kernel = _kernel(256, 128, "int4", 64)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 256)), jnp.float32)
    ref = x @ qwix.dequantize(kernel)
    out = gm.grouped_matmul(x.astype(jnp.bfloat16), kernel.qvalue,
                            kernel.scale.astype(jnp.bfloat16), group=64, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert float(jnp.abs(out.astype(jnp.float32) - ref).max()) < 0.02 * float(jnp.abs(ref).max())


def test_splits_reach_the_target_programs_in_whole_groups():
    assert gm.choose_splits(1, 64, 64) == 4              # 4096 columns: 64 blocks x 4 >= 132
    assert gm.choose_splits(1, 192, 64) == 1             # 12288 columns fill the GPU alone
    assert gm.choose_splits(1, 16, 6) == 6               # never more parts than groups
    assert all(gm.choose_splits(1, 8, g) in [d for d in range(1, g + 1) if g % d == 0]
               for g in (6, 12, 64, 192))


@pytest.mark.parametrize("k,n,group,ok", [(4096, 4096, 64, True), (4096, 1024, 128, True),
                                          (4096, 4096, 48, False), (4096, 96, 64, False),
                                          (96, 128, 64, False), (64, 128, 8, False)])
def test_supported_shapes(k, n, group, ok):
    assert gm.supported(k, n, group) is ok


def test_mosaic_blocks():
    assert gm.mosaic_blocks(4096, 12288, 64) == (1024, 512)      # the 8B's gate / up
    assert gm.mosaic_blocks(12288, 4096, 64) == (1024, 512)      # down
    assert gm.mosaic_blocks(4096, 1024, 128) == (1024, 512)      # k / v
    assert gm.mosaic_blocks(384, 384, 64) == (384, 128)          # the demo model: one block
    assert gm.mosaic_blocks(4096, 96, 64) is None                # no column block
    assert gm.mosaic_blocks(4096, 4096, 48) is None              # 48 does not divide a block
    assert gm.kernel_for("gpu") == "triton" and gm.kernel_for("tpu") == "mosaic"
    with pytest.raises(ValueError, match="run on a GPU .* or a TPU .*, not 'cpu'"):
        gm.kernel_for("cpu")


def test_bad_shapes_refused_naming_them():
    kernel = _kernel(128, 64, "int4", 64)
    with pytest.raises(ValueError, match=r"grouped_matmul: x \(2, 96\), values \(128, 64\)"):
        gm.grouped_matmul(jnp.zeros((2, 96)), kernel.qvalue, kernel.scale, group=64,
                          interpret=True)
    with pytest.raises(ValueError, match="splits 3 does not divide the 2 groups"):
        gm.grouped_matmul(jnp.zeros((2, 128)), kernel.qvalue, kernel.scale, group=64,
                          interpret=True, splits=3)
    with pytest.raises(ValueError, match="the mosaic kernel takes .* K and N multiples of 128"):
        gm.grouped_matmul(jnp.zeros((2, 128)), kernel.qvalue, kernel.scale, group=64,
                          kernel="mosaic", interpret=True)
    with pytest.raises(ValueError, match="kernel 'cuda' is unknown; allowed: triton, mosaic"):
        gm.grouped_matmul(jnp.zeros((2, 128)), kernel.qvalue, kernel.scale, group=64,
                          kernel="cuda", interpret=True)


# ------------------------------------------------------------------------- the model's forms

def test_matmul_forms_per_platform():
    assert q.matmul_form("tpu") == "einsum" and q.matmul_form("cpu") == "einsum"
    assert q.matmul_form("gpu") == "gemm2d"
    assert q.matmul_form("gpu", "pallas") == "triton"
    assert q.matmul_form("tpu", "pallas") == "mosaic"
    assert q.matmul_form("tpu", "pallas", interpret=True) == "mosaic-interpret"
    assert q.matmul_form("cpu", "pallas", interpret=True) == "triton-interpret"
    with pytest.raises(ValueError, match="run on a GPU"):
        q.matmul_form("cpu", "pallas")
    with pytest.raises(ValueError, match="grouped_matmul 'triton' is unknown; allowed: xla, pallas"):
        q.matmul_form("gpu", "triton")


@pytest.mark.parametrize("scheme,group", [("int8", 0), ("int4", 0), ("int4", 32)])
def test_every_form_gives_the_same_logits(scheme, group):
    """The per-channel kernels in the projection's einsum (TPU, CPU) or as 2-D gemms (GPU), the
    grouped ones dequantized or through the kernel: the same model."""
    params = q.quantize_params(model_lib.random_params(CONFIG, head_scale=4.0), scheme, group)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 255, (2, 8)))
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    logits = {}
    for name, kw in (("einsum", {}), ("gemm2d", dict(platform="gpu", attention="dense")),
                     ("triton-interpret", dict(grouped_matmul="pallas", attention_interpret=True)),
                     ("mosaic-interpret", dict(grouped_matmul="pallas", attention_interpret=True,
                                               platform="tpu", attention="dense"))):
        model = model_lib.Transformer(CONFIG, **kw)
        with jax.default_matmul_precision("highest"):
            logits[name] = model.apply({"params": params}, tokens, pos)
    for name in ("gemm2d", "triton-interpret", "mosaic-interpret"):
        np.testing.assert_allclose(logits[name], logits["einsum"], rtol=1e-5, atol=1e-5)


def test_the_plan_takes_a_kernel_on_one_gpu_or_tpu_for_grouped_weights():
    assert gm.for_plan("gpu", 64, 1) == "pallas" and gm.for_plan("tpu", 64, 1) == "pallas"
    assert gm.for_plan("gpu", 0, 1) == "xla"             # per channel: the compiler reads it
    assert gm.for_plan("gpu", 64, 2) == "xla"            # split over a mesh
    assert gm.for_plan("cpu", 64, 1) == "xla"
    here = plan(CONFIG, method="ar", slots=2, capacity=64, quantize="int4", quantize_group=32)
    assert here.static.grouped_matmul == "xla"           # this CPU


def test_more_rows_than_the_kernel_takes_go_to_the_dequantized_gemm(monkeypatch):
    kernel = _kernel(128, 64, "int4", 32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 128)), jnp.float32)
    monkeypatch.setitem(gm.MAX_ROWS, "triton", 8)             # the kernel's, whatever the default
    with jax.default_matmul_precision("highest"):
        ref = jnp.einsum("...a,ab->...b", x, qwix.dequantize(kernel))
        calls = []
        real = gm.grouped_matmul
        monkeypatch.setattr(gm, "grouped_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = q.projection_einsum("...a,ab->...b", x, kernel, jnp.float32, "triton-interpret")
        assert calls == [1]                                   # 6 rows: the kernel
        monkeypatch.setitem(gm.MAX_ROWS, "triton", 4)
        again = q.projection_einsum("...a,ab->...b", x, kernel, jnp.float32, "triton-interpret")
        assert calls == [1]                                   # past MAX_ROWS: XLA's gemm
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(again, ref, rtol=1e-5, atol=1e-5)
