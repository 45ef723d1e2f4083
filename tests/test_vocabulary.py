"""One vocabulary for every door: the dtype names (wedlm_jax.dtypes) the train config, the
decoding options and wedlm-convert read, and the one byte formatter of the messages
(wedlm_jax.runtime.failures.format_bytes)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from train.config import TrainConfigError, load_config
from wedlm_jax.checkpoints import tensors
from wedlm_jax.dtypes import DtypeError, allowed, canonical, dtype_name, jnp_dtype
from wedlm_jax.runtime.failures import format_bytes
from wedlm_jax.safetensors_io import CheckpointError


@pytest.mark.parametrize("spelling, name", [
    ("float32", "float32"), ("f32", "float32"), ("fp32", "float32"), (jnp.float32, "float32"),
    (np.dtype("float32"), "float32"), ("bfloat16", "bfloat16"), ("bf16", "bfloat16"),
    (jnp.bfloat16, "bfloat16"), (jnp.dtype("bfloat16"), "bfloat16"),
])
def test_every_spelling_has_one_name(spelling, name):
    assert canonical(spelling) == dtype_name(spelling) == name
    assert jnp_dtype(spelling) == jnp.dtype(name)


@pytest.mark.parametrize("bad", ["fp8", "float16", "BF16", "", None, np.float16, 3])
def test_anything_else_is_refused_naming_the_allowed_values(bad):
    assert canonical(bad) is None
    with pytest.raises(DtypeError) as e:
        dtype_name(bad)
    assert str(e.value) == (f"dtype {bad!r} is unknown; allowed: float32, bfloat16 "
                            "(f32, fp32, bf16)")


def test_a_door_narrows_the_table_and_names_its_field():
    assert allowed(("float32",)) == "float32 (f32, fp32)"
    assert dtype_name("fp32", ("float32",), "param_dtype") == "float32"
    with pytest.raises(DtypeError, match=r"^param_dtype 'bf16' is unknown; allowed: float32 "
                                         r"\(f32, fp32\)$"):
        dtype_name("bf16", ("float32",), "param_dtype")


def test_train_and_convert_read_the_same_table(tmp_path):
    """fp32 (an alias of the table) is a compute dtype of the train config and a dtype of
    wedlm-convert; a dtype outside the table is refused by both."""
    cfg = load_config(None, ["model.config={}", "data.train_files=[x.jsonl]",
                             "compute_dtype=fp32", "optimizer.mu_dtype=bf16"])
    from train.config import compute_dtype
    assert compute_dtype(cfg) == jnp.float32
    with pytest.raises(TrainConfigError, match="compute_dtype must be one of bf16, f32"):
        load_config(None, ["model.config={}", "data.train_files=[x.jsonl]", "compute_dtype=f16"])
    assert tensors.parse_dtype("fp32") == np.dtype(np.float32)
    assert tensors.parse_dtype("bf16") == np.dtype(jnp.bfloat16)
    assert tensors.parse_dtype(None) is None
    with pytest.raises(CheckpointError, match=r"^dtype 'f16' is unknown; allowed: float32, "
                                              r"bfloat16 \(f32, fp32, bf16\)$"):
        tensors.parse_dtype("f16")


@pytest.mark.parametrize("n, unit, text", [
    (0, None, "0 bytes"), (1023, None, "1023 bytes"), (1024, None, "1.00 KiB"),
    (393216, None, "384.00 KiB"), (3 << 20, None, "3.00 MiB"), (int(1.5 * (1 << 30)), None, "1.50 GiB"),
    (1 << 40, None, "1024.00 GiB"), (393216, "GiB", "0.00 GiB"), (5 << 30, "MiB", "5120.00 MiB"),
    (-(2 << 30), None, "-2.00 GiB"),
])
def test_one_byte_formatter(n, unit, text):
    assert format_bytes(n, unit) == text


def test_the_byte_formatter_refuses_an_unknown_unit():
    with pytest.raises(ValueError, match="unit 'GB' is unknown; allowed: GiB, MiB, KiB"):
        format_bytes(1, "GB")
