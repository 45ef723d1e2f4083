"""A config.json with both `rope_parameters` and `rope_scaling`: read as transformers
reads it (rope_scaling replaces rope_parameters whole), checked against transformers' own config
resolution and against its logits; refused when rope_parameters' rope_theta would be dropped."""

import json
import warnings

import numpy as np
import pytest
import transformers

from tests.synthetic.hf import hf_logits, make_hf_model
from wedlm_jax.config import ConfigError, ModelConfig
from wedlm_jax.checkpoints import load_hf_checkpoint
from wedlm_jax.model import Transformer

BASE = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

CONSISTENT = [  # (rope_parameters, rope_scaling, top-level extras): none contradicts
    ({"rope_type": "default", "rope_theta": 10000.0}, YARN, {}),
    ({"rope_type": "default", "rope_theta": 1e6}, {**YARN, "rope_theta": 1e6}, {}),
    ({"rope_type": "default", "rope_theta": 5e5}, YARN, {"rope_theta": 5e5}),
    ({"rope_type": "linear", "factor": 3.0}, {"type": "linear", "factor": 2.0}, {"rope_theta": 7e3}),
    ({"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4}, {}, {}),  # empty rope_scaling
    ({}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}, {}),
]


def _transformers_rope(d):
    cfg = transformers.Qwen3Config.from_dict(json.loads(json.dumps(d)))
    p = dict(cfg.rope_parameters)
    p.pop("type", None)
    return p


@pytest.mark.parametrize("params,scaling,top", CONSISTENT)
def test_resolution_matches_transformers(params, scaling, top):
    d = {**BASE, **top, "rope_parameters": params, "rope_scaling": scaling}
    want = _transformers_rope(d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mc = ModelConfig.from_hf_dict(json.loads(json.dumps(d)))
    got = {**mc.rope_params, "rope_theta": mc.rope_theta}
    for key in ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor"):
        assert got.get(key) == want.get(key), (key, got, want)
    if want["rope_type"] in ("yarn", "llama3"):
        assert got.get("original_max_position_embeddings",
                       BASE["max_position_embeddings"]) == want["original_max_position_embeddings"]


def test_both_keys_logits_match_transformers(tmp_path):
    path = make_hf_model("qwen3", tmp_path / "hf", rope="default", max_position_embeddings=64)
    cfg_file = tmp_path / "hf" / "config.json"
    d = json.loads(cfg_file.read_text())
    d.pop("rope_theta", None)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    d["rope_scaling"] = dict(YARN)  # YaRN added the way the Qwen model cards say
    cfg_file.write_text(json.dumps(d))
    with pytest.warns(UserWarning, match="rope_scaling is used whole and rope_parameters' "
                                         "rope_type ignored"):
        config, params = load_hf_checkpoint(path, progress=False)
    assert config.rope_params["rope_type"] == "yarn"
    tokens = (np.arange(80).reshape(2, 40) * 7) % 96
    positions = np.broadcast_to(np.arange(40), (2, 40))  # past the original 16 positions
    ours = np.asarray(Transformer(config).apply({"params": params}, tokens, positions))
    ref = hf_logits(path, tokens, positions)
    assert np.abs(ours - ref).max() <= 1e-4
    # the rope_parameters reading (plain RoPE) is measurably different: the check has teeth
    plain = Transformer(config.replace(rope_scaling=(("rope_type", "default"),)))
    assert np.abs(np.asarray(plain.apply({"params": params}, tokens, positions)) - ref).max() > 1e-2


def test_contradicting_theta_refused():
    d = {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
         "rope_scaling": dict(YARN)}
    assert _transformers_rope(d)["rope_theta"] == 10000.0  # what transformers would silently use
    with pytest.raises(ConfigError, match=r"rope_parameters and rope_scaling are both set and "
                                          r"contradict: transformers uses rope_scaling alone, "
                                          r"which gives rope_theta 10000.0 \(from the default\), "
                                          r"while rope_parameters says rope_theta 1000000.0"):
        ModelConfig.from_hf_dict(d, source="cfg.json")
