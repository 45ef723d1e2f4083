"""QLoRA on the tiny setup (CPU): LoRA adapters trained on a frozen base quantized with decoding's
schemes (`lora.base_quantize`). The adapted forward on a quantized base is the forward of its
dequantized weights with the same adapters (and the gradients too), off the float base's by the
quantization error only; a run trains the adapters alone, resumes exactly, refuses a base
quantized otherwise, and exports a PEFT folder; bad settings are refused by name before anything
loads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from tests.synthetic import train_data as fixtures
from train import checkpoint as ckpt
from train import lora as lora_train
from train import main as main_lib
from train.config import TrainConfigError, config_from_dict, model_config
from wedlm_jax.lora import apply as lora_lib
from wedlm_jax import model as model_lib
from wedlm_jax.lora import peft
from wedlm_jax import quantize
from wedlm_jax.config import ModelConfig
from wedlm_jax.lora.spec import LoraSpec

QLORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": ["q", "v", "o", "down"],
         "lora.base_quantize": "int4", "lora.base_quantize_group": 8}
SCHEMES = [("int8", 0), ("int4", 8)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return fixtures.make_tiny_setup(str(tmp_path_factory.mktemp("qlora")), num_docs=40)


def _cfg(paths, **over):
    return config_from_dict(fixtures.tiny_config_dict(paths, **{**QLORA, **over}))


def _dequantized(params):
    is_q = lambda x: isinstance(x, qwix.QArray)  # noqa: E731
    return jax.tree.map(lambda x: qwix.dequantize(x) if is_q(x) else x, params, is_leaf=is_q)


@pytest.fixture(scope="module")
def tiny():
    mc = ModelConfig(**fixtures.TINY_MODEL, mask_token_id=95)
    spec = LoraSpec(4, 8.0, 0.0, ("q", "k", "v", "o", "gate", "up", "down"))
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda s: 0.1 * rng.standard_normal(s.shape).astype(np.float32),
                            lora_lib.adapter_shapes(mc, spec))
    tokens = rng.integers(0, 90, (2, 16))
    return mc, spec, model_lib.random_params(mc), adapters, tokens


def _forward(tiny, params, adapters, platform=None):
    mc, spec, _, _, tokens = tiny
    model = lora_lib.lora_model(model_lib.Transformer(mc, attention="dense", platform=platform),
                                spec, dropout=0.0)
    positions = np.tile(np.arange(tokens.shape[1]), (tokens.shape[0], 1))
    return model.apply({"params": lora_lib.combine(params, adapters)}, tokens, positions)


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_forward_is_the_dequantized_bases_plus_the_adapters(tiny, scheme, group):
    _, _, params, adapters, _ = tiny
    qbase = quantize.quantize_params(params, scheme, group)
    zero = jax.tree.map(np.zeros_like, adapters)
    ours = np.asarray(_forward(tiny, qbase, adapters))
    np.testing.assert_allclose(ours, _forward(tiny, _dequantized(qbase), adapters), atol=2e-5)
    adapted = np.abs(ours - np.asarray(_forward(tiny, qbase, zero))).max()
    assert adapted > 0.1                            # the adapters act on the quantized kernels
    q_error = np.abs(np.asarray(_forward(tiny, qbase, zero) - _forward(tiny, params, zero))).max()
    off = np.abs(ours - np.asarray(_forward(tiny, params, adapters))).max()
    assert 0 < off < 3 * q_error < adapted          # off the float base's by its quantization


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_the_gpu_matmul_form_too(tiny, scheme, group):
    """On GPU a per-channel kernel enters one 2-D gemm (quantize.matmul_form "gemm2d"): the
    adapters' term is added there too."""
    _, _, params, adapters, _ = tiny
    qbase = quantize.quantize_params(params, scheme, group)
    np.testing.assert_allclose(_forward(tiny, qbase, adapters, "gpu"),
                               _forward(tiny, _dequantized(qbase), adapters), atol=2e-5)


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_gradients_reach_the_adapters_only(tiny, scheme, group):
    _, _, params, adapters, _ = tiny
    qbase = quantize.quantize_params(params, scheme, group)
    loss = lambda a, base: jnp.mean(_forward(tiny, base, a) ** 2)  # noqa: E731
    ours = jax.grad(loss)(adapters, qbase)
    ref = jax.grad(loss)(adapters, _dequantized(qbase))
    assert jax.tree.structure(ours) == jax.tree.structure(adapters)
    for g, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        assert np.abs(np.asarray(g)).max() > 0
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("over,match", [
    ({"lora.base_quantize": "int3"}, r"lora\.base_quantize 'int3' is unknown; allowed: none, int8, "
                                     r"int4"),
    ({"lora.base_quantize_group": -1}, r"lora\.base_quantize_group must be an int >= 0"),
    ({"lora.base_quantize": "none"}, r"lora\.base_quantize_group 8 needs a scheme: "
                                     r"lora\.base_quantize int8 or int4"),
    ({"lora.rank": 0}, r"lora\.base_quantize 'int4' quantizes LoRA's frozen base and needs "
                       r"lora\.rank > 0"),
    ({"lora.rank": 0, "lora.base_quantize": "none"}, r"lora\.base_quantize_group 8 needs "
                                                     r"lora\.rank > 0"),
])
def test_bad_settings_are_named(paths, over, match):
    with pytest.raises(TrainConfigError, match=match):
        _cfg(paths, **over)


def test_a_group_the_model_does_not_tile_is_named(paths):
    cfg = _cfg(paths, **{"lora.base_quantize_group": 12})      # hidden 32, head_dim 8
    with pytest.raises(TrainConfigError, match=r"lora\.base_quantize_group 12 does not divide the "
                                               r"input axis of q_proj \(32\)"):
        model_config(cfg)
    with pytest.raises(TrainConfigError, match=r"lora\.base_quantize_group 64 does not divide"):
        main_lib.prepare(_cfg(paths, **{"lora.base_quantize_group": None}))  # int4's default 64


def test_base_shapes_are_the_quantized_ones(paths):
    cfg = _cfg(paths)
    mc = model_config(cfg)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1),
                             ("data", "fsdp", "tensor"))
    shapes = lora_train.base_shapes(cfg, mc, mesh)
    q = shapes["layers"]["attn"]["q_proj"]["kernel"]
    assert isinstance(q, qwix.QArray) and q.qvalue.dtype == jnp.int4
    assert q.scale.shape == (mc.num_layers, mc.hidden_size // 8, mc.num_heads, mc.head_dim)
    assert q.qvalue.sharding.mesh == mesh
    assert shapes["embedding"].qvalue.dtype == jnp.int8
    assert quantize.weight_bytes(shapes) < quantize.weight_bytes(
        lora_train.base_shapes(_cfg(paths, **{"lora.base_quantize": "none",
                                              "lora.base_quantize_group": None}), mc, mesh)) / 2


def _run(cfg):
    res = main_lib.run(cfg, progress=False)
    return res, {r["step"]: r["loss"] for r in res["records"]}


def test_train_resume_export_refuse(paths, tmp_path):
    over = {"checkpoint.every": 2, "lora.dropout": 0.1, "steps": 4}
    a_dir, b_dir = str(tmp_path / "a"), str(tmp_path / "b")
    straight, losses_a = _run(_cfg(paths, **over, **{"checkpoint.dir": a_dir}))
    state = straight["state"]
    assert losses_a[4] < losses_a[1]
    n_adapter = sum(x.size for x in jax.tree.leaves(state["params"]))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["params"]))
    assert set(state["params"]["layers"]["attn"]) == {"q_proj", "v_proj", "o_proj"}
    assert sum(x.size for x in jax.tree.leaves(state["opt_state"])) <= 2 * n_adapter + 8
    _run(_cfg(paths, **{**over, "steps": 2, "checkpoint.dir": b_dir}))
    out = str(tmp_path / "adapter")
    resumed, losses_b = _run(_cfg(paths, **over, **{"checkpoint.dir": b_dir,
                                                    "checkpoint.export_hf": out}))
    assert resumed["start_step"] == 2
    assert [losses_b[s] for s in (3, 4)] == [losses_a[s] for s in (3, 4)]
    for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(resumed["state"]["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    base_hash = ckpt.read_config(b_dir, 4)["lora"]["base_hash"]
    assert base_hash == ckpt.read_config(a_dir, 4)["lora"]["base_hash"]
    spec, adapters = peft.load_peft(out, resumed["model_config"])
    assert spec.rank == 4
    np.testing.assert_array_equal(adapters["layers"]["attn"]["q_proj"]["kernel_lora_b"],
                                  np.asarray(state["params"]["layers"]["attn"]["q_proj"]
                                             ["kernel_lora_b"]))
    assert not ckpt.meaning_diff({"lora": {"base_quantize_group": None}},
                                 {"lora": {"base_quantize_group": 64}})    # unset: the default
    with pytest.raises(ckpt.ResumeError, match="refusing to resume on another base"):
        main_lib.run(_cfg(paths, **{**over, "lora.base_quantize_group": 4, "steps": 6,
                                    "checkpoint.dir": b_dir}), progress=False)   # by its hash
    for other in ({"lora.base_quantize": "int8", "lora.base_quantize_group": 0},
                  {"lora.base_quantize": "none", "lora.base_quantize_group": None}):
        with pytest.raises(ckpt.ResumeError, match=r"lora\.base_quantize: 'int[48]'"):
            main_lib.run(_cfg(paths, **{**over, **other, "steps": 6, "checkpoint.dir": b_dir}),
                         progress=False)
        with pytest.raises(ckpt.ResumeError, match=f"lora.base_hash {base_hash} is not the hash"):
            main_lib.run(_cfg(paths, **{**over, **other, "lora.base_hash": base_hash,
                                        "checkpoint.dir": str(tmp_path / "c")}), progress=False)


def test_dry_run_reports_the_quantized_base(paths):
    from train import dry_run
    bf16 = dry_run.report(_cfg(paths, **{"compute_dtype": "bf16", "lora.base_quantize": "none",
                                         "lora.base_quantize_group": None}), 1)
    int4 = dry_run.report(_cfg(paths, **{"compute_dtype": "bf16"}), 1)
    assert int4["memory"]["argument"] < bf16["memory"]["argument"]
    assert int4["step_flops_per_device"] > 0
    assert int4["lora"] == "rank 4 on q, v, o, down, the base frozen int4 (groups of 8)"
    assert bf16["lora"].endswith("the base frozen in bf16")
