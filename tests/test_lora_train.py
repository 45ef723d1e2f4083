"""LoRA training on the tiny setup (CPU): the `lora` section's checks by name; at step 0 the adapted
loss is the full model's (both losses, the dual-stream arrangement unchanged); a run trains the
adapters only (the state and the optimizer hold nothing else), checkpoints the base's hash,
exports a PEFT folder, resumes exactly, and refuses to resume on another base."""

import os

import jax
import numpy as np
import pytest

from tests.synthetic import train_data as fixtures
from train import checkpoint as ckpt
from train import lora as lora_train
from train import main as main_lib
from train import step as step_lib
from train.config import TrainConfigError, config_from_dict
from wedlm_jax import masking
from wedlm_jax.lora import peft
from wedlm_jax import model as model_lib
from wedlm_jax.config import ModelConfig

LORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": ["q", "v", "o", "down"]}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return fixtures.make_tiny_setup(str(tmp_path_factory.mktemp("lora")), num_docs=40)


def _cfg(paths, **over):
    return config_from_dict(fixtures.tiny_config_dict(paths, **{**LORA, **over}))


@pytest.mark.parametrize("key,value,match", [
    ("lora.rank", 4096, r"lora\.rank must be an integer in \[1, 1024\]"),
    ("lora.targets", ["q", "lm_head"], r"lora\.targets 'lm_head' is not a projection; allowed: "
                                       r"q, k, v, o, gate, up, down"),
    ("lora.dropout", 1.0, r"lora\.dropout must be in \[0, 1\)"),
    ("lora.alpha", 0, r"lora\.alpha must be a number > 0"),
])
def test_bad_lora_settings_are_named(paths, key, value, match):
    with pytest.raises(TrainConfigError, match=match):
        _cfg(paths, **{key: value})


def test_step_zero_loss_is_the_full_models(paths):
    cfg, full = _cfg(paths), _cfg(paths, **{"lora.rank": 0})
    mc = ModelConfig(**fixtures.TINY_MODEL, mask_token_id=95)
    params = model_lib.random_params(mc)
    adapters = lora_train.initial_adapters(cfg, mc)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 90, (2, 32))
    arr = masking.arrange_rows("dual", masking.row_keys(0, 0, np.arange(2)), tokens,
                               np.ones_like(tokens), np.ones_like(tokens, bool), block_size=8,
                               mask_token_id=95)
    arr = {k: v for k, v in arr.items() if k != "source"}
    from wedlm_jax import losses
    totals = losses.weight_totals(arr)
    ours, t1 = step_lib.make_loss_fn(cfg, mc)(adapters, arr, totals, (params, None))
    theirs, t2 = step_lib.make_loss_fn(full, mc)(params, arr, totals)
    assert abs(float(ours) - float(theirs)) < 1e-6
    for k in t2:
        np.testing.assert_allclose(t1[k], t2[k], rtol=1e-6)


def _run(cfg):
    res = main_lib.run(cfg, progress=False)
    return res, {r["step"]: r["loss"] for r in res["records"]}


def test_train_resume_export(paths, tmp_path):
    over = {"checkpoint.every": 2, "lora.dropout": 0.1, "steps": 4}
    straight, losses_a = _run(_cfg(paths, **over, **{"checkpoint.dir": str(tmp_path / "a")}))
    state = straight["state"]
    shapes = jax.tree.map(lambda x: x.shape, state["params"])
    assert set(shapes["layers"]["attn"]) == {"q_proj", "v_proj", "o_proj"}
    assert set(shapes["layers"]["mlp"]) == {"down_proj"}
    n_adapter = sum(x.size for x in jax.tree.leaves(state["params"]))
    n_opt = sum(x.size for x in jax.tree.leaves(state["opt_state"]))
    assert n_opt <= 2 * n_adapter + 8               # AdamW's two moments and its counters
    assert losses_a[4] < losses_a[1]
    b_dir = str(tmp_path / "b")
    _run(_cfg(paths, **{**over, "steps": 2, "checkpoint.dir": b_dir}))
    out = str(tmp_path / "adapter")
    resumed, losses_b = _run(_cfg(paths, **over, **{"checkpoint.dir": b_dir,
                                                    "checkpoint.export_hf": out}))
    assert resumed["start_step"] == 2
    assert [losses_b[s] for s in (3, 4)] == [losses_a[s] for s in (3, 4)]
    for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(resumed["state"]["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    saved = ckpt.read_config(b_dir, 4)["lora"]
    assert len(saved["base_hash"]) == 16
    spec, adapters = peft.load_peft(out, resumed["model_config"])
    assert spec.rank == 4 and spec.targets == ("q_proj", "v_proj", "o_proj", "down_proj")
    np.testing.assert_array_equal(adapters["layers"]["attn"]["q_proj"]["kernel_lora_b"],
                                  np.asarray(state["params"]["layers"]["attn"]["q_proj"]
                                             ["kernel_lora_b"]))


def test_another_base_is_refused(paths, tmp_path):
    from wedlm_jax.checkpoints import save_hf_checkpoint
    mc = ModelConfig(**fixtures.TINY_MODEL)
    base = str(tmp_path / "base")

    def write_base(seed):
        save_hf_checkpoint(mc, model_lib.random_params(mc, seed), base, force=True,
                           tokenizer_from=paths["tokenizer"], progress=False)
    write_base(0)
    over = {"model.config": None, "model.from_hf": base, "steps": 2,
            "checkpoint.dir": str(tmp_path / "ck")}
    first, _ = _run(_cfg(paths, **over))
    write_base(1)                                   # the same folder, other weights
    with pytest.raises(ckpt.ResumeError, match="refusing to resume on another base"):
        main_lib.run(_cfg(paths, **{**over, "steps": 3}), progress=False)
    with pytest.raises(ckpt.ResumeError, match="lora.base_hash 0123456789abcdef is not the hash"):
        main_lib.run(_cfg(paths, **{**over, "lora.base_hash": "0123456789abcdef",
                                    "checkpoint.dir": str(tmp_path / "ck2")}), progress=False)
    assert os.path.isdir(tmp_path / "ck" / "2")


def test_dry_run_reports_the_adapted_step(paths):
    from train import dry_run
    full = dry_run.report(_cfg(paths, **{"lora.rank": 0}), 1)
    adapted = dry_run.report(_cfg(paths, **{"compute_dtype": "bf16"}), 1)
    assert adapted["memory"]["argument"] < full["memory"]["argument"] / 2
    assert adapted["step_flops_per_device"] > 0
