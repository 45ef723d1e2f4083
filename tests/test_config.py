"""ModelConfig from Hugging Face config.json: model types, RoPE sources and types, bad input."""

import json

import numpy as np
import pytest

from wedlm_jax.config import SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES, ConfigError, ModelConfig
from wedlm_jax.rope import rope_frequencies

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)


def test_model_types_set_the_architecture_flags():
    q2 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2"})
    assert (q2.qkv_bias, q2.o_bias, q2.qk_norm, q2.head_dim) == (True, False, False, 16)
    q3 = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim) == (False, True, 32)
    ll = ModelConfig.from_hf_dict({**BASE, "model_type": "llama", "attention_bias": True})
    assert (ll.qkv_bias, ll.o_bias, ll.qk_norm) == (True, True, False)
    we = ModelConfig.from_hf_dict({**BASE, "model_type": "wedlm", "attention_bias": True, "qk_norm": False,
                                   "mask_token_id": 99, "tie_word_embeddings": True})
    assert (we.qkv_bias, we.o_bias, we.qk_norm, we.mask_token_id, we.tie_word_embeddings) == \
        (True, False, False, 99, True)
    we8 = ModelConfig.from_hf_dict({**BASE, "model_type": "wedlm", "attention_bias": False, "qk_norm": True})
    assert (we8.qkv_bias, we8.qk_norm) == (False, True)
    assert q2.rms_norm_eps == 1e-5


def test_rope_theta_from_old_and_new_fields():
    old = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "rope_theta": 1e6,
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2",
                                    "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1e6}})
    assert old.rope_theta == new.rope_theta == 1e6
    assert old.rope_params == new.rope_params == {"rope_type": "linear", "factor": 2.0}
    np.testing.assert_array_equal(rope_frequencies(old)[0], rope_frequencies(new)[0])
    default = ModelConfig.from_hf_dict({**BASE, "model_type": "llama"})
    assert default.rope_theta == 10000.0 and default.rope_params == {"rope_type": "default"}


def test_to_hf_dict_round_trips():
    cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen3", "head_dim": 32, "mask_token_id": 7,
                                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 64,
                                                        "rope_theta": 5e5}})
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_num_params_matches_the_tree():
    import jax
    from wedlm_jax.model import param_shapes
    for mt, extra in [("qwen2", {}), ("qwen3", {"tie_word_embeddings": True}), ("llama", {"mlp_bias": True})]:
        cfg = ModelConfig.from_hf_dict({**BASE, "model_type": mt, **extra})
        assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(param_shapes(cfg)))


@pytest.mark.parametrize("bad,words", [
    ({"model_type": "gpt2"}, ["'gpt2'", *SUPPORTED_MODEL_TYPES]),
    ({"model_type": "qwen2", "rope_parameters": {"rope_type": "longrope", "factor": 2.0}},
     ["'longrope'", *SUPPORTED_ROPE_TYPES]),
    ({"model_type": "qwen2", "rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["'dynamic'", "yarn"]),
    ({"model_type": "wedlm", "mask_token_id": 100}, ["mask_token_id", "100", "[0, 100)"]),
    ({"model_type": "qwen2", "rope_parameters": {"rope_type": "linear"}}, ["linear", "factor"]),
    ({"model_type": "qwen2", "hidden_act": "gelu"}, ["hidden_act", "gelu"]),
    ({"model_type": "llama", "num_key_value_heads": 3}, ["num_key_value_heads", "3"]),
])
def test_bad_configs_name_the_offender(bad, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict({**BASE, **bad})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_missing_field_and_bad_json(tmp_path):
    d = {**BASE, "model_type": "qwen2"}
    del d["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path / "missing")
