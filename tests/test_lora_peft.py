"""PEFT folders both ways on a tiny HF model (CPU, float32): adapters written here load with
`peft.PeftModel.from_pretrained` onto the transformers model and give our adapted logits; a PEFT
adapter made by peft (random weights) loads here with the same logits, merged or not; bad
folders (DoRA, rank patterns, a rank over the bound, another base's shapes) are refused in one
line naming the option or the tensor."""

import json
import os

import numpy as np
import pytest

from tests.synthetic.hf import make_hf_model
from wedlm_jax.lora import apply as lora_lib
from wedlm_jax.lora import peft as peft_lib
from wedlm_jax.checkpoints import load_hf_checkpoint
from wedlm_jax.lora.spec import LoraError, LoraSpec
from wedlm_jax.model import Transformer

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_hf_model("qwen3", tmp_path_factory.mktemp("hf") / "base", head_dim=16)
    config, params = load_hf_checkpoint(path, dtype="f32", progress=False)
    return path, config, params


def _tokens():
    rng = np.random.default_rng(0)
    return rng.integers(0, 96, (2, 10)), np.tile(np.arange(10), (2, 1))


def _ours(config, params, adapters, spec):
    tokens, positions = _tokens()
    model = lora_lib.lora_model(Transformer(config), spec, dropout=0.0)
    return np.asarray(model.apply({"params": lora_lib.combine(params, adapters)}, tokens,
                                  positions))


def _peft_logits(base_path, adapter_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter_path).eval()
    tokens, positions = _tokens()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens),
                     position_ids=torch.as_tensor(positions)).logits.numpy()


def _random_adapters(config, spec, seed=1):
    rng = np.random.default_rng(seed)
    return {"layers": {g: {n: {k: 0.1 * rng.standard_normal(v.shape).astype(np.float32)
                               for k, v in ab.items()} for n, ab in mods.items()}
                       for g, mods in lora_lib.init_adapters(config, spec)["layers"].items()}}


@pytest.mark.parametrize("targets", [("all-linear",), ("q", "v", "down")])
def test_export_loads_in_peft_with_our_logits(base, tmp_path, targets):
    path, config, params = base
    spec = LoraSpec(rank=4, alpha=12.0, targets=targets)
    adapters = _random_adapters(config, spec)
    out = peft_lib.save_peft(config, adapters, spec, tmp_path / "adapter", base=path)
    ours = _ours(config, params, adapters, spec)
    theirs = _peft_logits(path, out)
    assert np.abs(ours - theirs).max() <= 1e-4
    plain = np.asarray(Transformer(config).apply({"params": params}, *_tokens()))
    assert np.abs(ours - plain).max() > 1e-2       # the adapter changes the logits
    spec2, back = peft_lib.load_peft(out, config)
    assert spec2 == spec
    np.testing.assert_array_equal(back["layers"]["mlp"]["down_proj"]["kernel_lora_b"],
                                  adapters["layers"]["mlp"]["down_proj"]["kernel_lora_b"])


def _peft_made(base_path, out, **config_kw):
    """A PEFT adapter made by peft itself, its lora_B random (peft starts it at zero)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    kw = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj", "up_proj"])
    kw.update(config_kw)
    model = peft.get_peft_model(model, peft.LoraConfig(**kw))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return str(out)


def test_peft_adapter_imports_and_merges(base, tmp_path):
    path, config, params = base
    folder = _peft_made(path, tmp_path / "made")
    spec, adapters = peft_lib.load_peft(folder, config)
    assert spec.rank == 8 and spec.targets == ("q_proj", "k_proj", "o_proj", "up_proj")
    theirs = _peft_logits(path, folder)
    assert np.abs(_ours(config, params, adapters, spec) - theirs).max() <= 1e-4
    merged = lora_lib.fold(params, adapters, spec)
    ours = np.asarray(Transformer(config).apply({"params": merged}, *_tokens()))
    assert np.abs(ours - theirs).max() <= 1e-4


def test_convert_merge_writes_a_merged_checkpoint(base, tmp_path):
    from tests.synthetic.hf import hf_logits
    from wedlm_jax import convert
    path, config, params = base
    folder = _peft_made(path, tmp_path / "made")
    out = tmp_path / "merged"
    assert convert.main(["lora-merge", "--hf", path, "--lora", folder, "--out", str(out),
                         "--no-progress"]) == 0
    assert np.abs(hf_logits(str(out), *_tokens()) - _peft_logits(path, folder)).max() <= 1e-4


def _edit_config(folder, **changes):
    p = os.path.join(folder, peft_lib.CONFIG_FILE)
    with open(p) as f:
        c = json.load(f)
    c.update(changes)
    with open(p, "w") as f:
        json.dump(c, f)


@pytest.mark.parametrize("change,match", [
    ({"use_dora": True}, "use_dora=True: DoRA adapters are not supported"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern=.*per-module ranks"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern=.*per-module alphas"),
    ({"r": 4096}, "r=4096 is above the rank bound 1024"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\]"),
])
def test_bad_folders_are_refused_in_one_line(base, tmp_path, change, match):
    path, config, _ = base
    folder = _peft_made(path, tmp_path / "made")
    _edit_config(folder, **change)
    with pytest.raises(LoraError, match=match) as e:
        peft_lib.load_peft(folder, config)
    assert "\n" not in str(e.value)


def test_another_base_is_named_by_tensor(base, tmp_path):
    path, config, _ = base
    other = make_hf_model("qwen3", tmp_path / "other", head_dim=16, hidden=48)
    folder = _peft_made(other, tmp_path / "made")
    with pytest.raises(LoraError, match=r"tensor base_model\.model\.model\.layers\.\d+\.\w+\."
                                        r"\w+_proj\.lora_[AB]\.weight: shape \(\d+, \d+\), the "
                                        r"model needs"):
        peft_lib.load_peft(folder, config)
