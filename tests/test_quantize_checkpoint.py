"""Quantized Orbax checkpoints (wedlm_jax/checkpoints/quantized.py, `wedlm-convert hf-to-orbax
--quantize`): the weights and the greedy tokens of a converted folder are those of quantizing at
load, the doors refuse a folder quantized otherwise than the plan says, a damaged scale tensor is
named at load, and a quantized folder is not exported back to Hugging Face."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from decode import cli
from decode.checkpoint import OpenCheckpoint
from decode.config import DecodeConfig, DecodeConfigError, Placement
from decode.static.static_batch import generate
from tests.tiny_checkpoint import make_checkpoint
from wedlm_jax import convert
from wedlm_jax import quantize as q
from wedlm_jax.checkpoints import quantized as qc
from wedlm_jax.checkpoints import CheckpointError, load_checkpoint

SCHEMES = (("int8", None), ("int4", 8))      # the tiny model's head_dim is 8: int4 groups of 8
PROMPTS = [[5, 9, 11], [3, 4], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny Hugging Face folder and its int8 / int4 conversions (through the command)."""
    root = tmp_path_factory.mktemp("qckpt")
    hf, config, _ = make_checkpoint(root)
    out = {"hf": hf}
    for scheme, group in SCHEMES:
        dest = os.path.join(root, scheme)
        argv = ["hf-to-orbax", "--hf", hf, "--out", dest, "--quantize", scheme, "--no-progress"]
        assert convert.main(argv + (["--quantize-group", str(group)] if group else [])) == 0
        out[scheme] = dest
    return out


def _leaves_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert bool((x == y).all())


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_converted_folder_decodes_as_quantizing_at_load(folders, scheme, group):
    with open(os.path.join(folders[scheme], qc.QUANT_FILE)) as f:
        assert json.load(f)["scheme"] == scheme
    config, stored = load_checkpoint(folders[scheme])
    _, floats = load_checkpoint(folders["hf"])
    at_load = q.quantize_params(floats, scheme, group)
    _leaves_equal(stored, at_load)
    dc = DecodeConfig(method="ar", max_new_tokens=12)
    place = Placement(quantize=scheme, quantize_group=group)
    ckpt = OpenCheckpoint.open(folders[scheme], place, method="ar")
    cfg, door, _ = ckpt.load()                  # the door: no quantizing again, the same weights
    _leaves_equal(door, at_load)
    a = generate(door, cfg, PROMPTS, dc).tokens
    b = generate(at_load, config, PROMPTS, dc).tokens
    assert a == b and all(len(t) == 12 for t in a)
    _, per_layer = qc.load(folders[scheme], stacked_layers=False)   # GPU's tree, loaded so
    assert "layer_1" in per_layer and q.scheme_of(per_layer) == (scheme, group or 0)


def test_door_refuses_a_folder_quantized_otherwise(folders, capsys):
    with pytest.raises(DecodeConfigError, match=r"holds weights quantized int8 \(per output "
                       r"channel\); the plan says --quantize int4 \(groups of 8\)") as e:
        OpenCheckpoint.open(folders["int8"], Placement(quantize="int4", quantize_group=8))
    assert e.value.field == "quantize"
    with pytest.raises(DecodeConfigError, match="the plan says --quantize none"):
        OpenCheckpoint.open(folders["int4"], Placement())
    code = cli.main(["--checkpoint", folders["int4"], "--prompt", "one two", "--method", "ar",
                     "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.endswith("decode it with --quantize int4 --quantize-group 8"), err
    code = cli.main(["--checkpoint", folders["int8"], "--dry-run", "--topology", "h100"])
    err = capsys.readouterr().err.strip()      # the dry run refuses it before compiling
    assert code == 2 and "holds weights quantized int8" in err and len(err.splitlines()) == 1


def test_export_of_a_quantized_folder_refused(folders, tmp_path, capsys):
    code = convert.main(["orbax-to-hf", "--orbax", folders["int8"], "--out",
                         str(tmp_path / "back"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "the Hugging Face folder it was converted from is the source of truth" in err
    assert not (tmp_path / "back").exists()


def test_bad_scheme_refused_before_reading(folders, tmp_path, capsys):
    code = convert.main(["hf-to-orbax", "--hf", folders["hf"], "--out", str(tmp_path / "x"),
                         "--quantize", "int4", "--quantize-group", "16", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--quantize-group: quantize_group 16 does not divide" in err, err


# ---------------------------------------------------------------------------- damaged scales

def _rewrite(src: str, dest, change) -> str:
    """A copy of the quantized folder `src` whose params/ holds `change(tree)`."""
    dest = os.fspath(dest)
    shutil.copytree(src, dest)
    _, qp = qc.load(src)
    tree = jax.tree.map(np.asarray, qc.to_storage(qp))
    change(tree)
    shutil.rmtree(os.path.join(dest, qc.PARAMS_DIR))
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    ckptr.save(os.path.join(dest, qc.PARAMS_DIR), args=ocp.args.PyTreeSave(tree))
    ckptr.close()
    return dest


def _kernel(tree, layer="attn", name="k_proj"):
    return tree["layers"][layer][name]["kernel"]


def _nan(tree):
    s = _kernel(tree)["scale"].copy()
    s.flat[3] = np.nan
    _kernel(tree)["scale"] = s


def _inf(tree):
    s = _kernel(tree, "mlp", "down_proj")["scale"].copy()
    s.flat[0] = np.inf
    _kernel(tree, "mlp", "down_proj")["scale"] = s


@pytest.mark.parametrize("change,message", [
    (lambda t: _kernel(t).pop("scale"), r"tensor layers\.attn\.k_proj\.kernel\.scale is missing"),
    (lambda t: _kernel(t).update(scale=_kernel(t)["scale"][:, :, :1]),
     r"tensor layers\.attn\.k_proj\.kernel\.scale has shape \[2, 1, 1, 8\], the config needs "
     r"\[2, 1, 2, 8\]"),
    (lambda t: _kernel(t).update(scale=_kernel(t)["scale"].astype(np.float16)),
     r"tensor layers\.attn\.k_proj\.kernel\.scale has dtype float16, the scheme needs float32"),
    (lambda t: _kernel(t).update(qvalue=_kernel(t)["qvalue"].astype(np.int32)),
     r"tensor layers\.attn\.k_proj\.kernel\.qvalue has dtype int32, the scheme needs int8"),
    (_nan, r"tensor layers\.attn\.k_proj\.kernel\.scale has 1 non-finite or non-positive value"),
    (_inf, r"tensor layers\.mlp\.down_proj\.kernel\.scale has 1 non-finite or non-positive"),
])
def test_damaged_scale_named_at_load(folders, tmp_path, capsys, change, message):
    bad = _rewrite(folders["int8"], tmp_path / "bad", change)
    params_dir = os.path.join(bad, qc.PARAMS_DIR)
    with pytest.raises(CheckpointError, match=message) as e:
        load_checkpoint(bad)
    assert str(e.value).startswith(params_dir + ": ") and "\n" not in str(e.value)
    code = cli.main(["--checkpoint", bad, "--prompt", "one two", "--method", "ar",
                     "--max-new-tokens", "2", "--quantize", "int8"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and params_dir in err, err


def test_damaged_record_named(folders, tmp_path):
    bad = shutil.copytree(folders["int8"], tmp_path / "rec")
    with open(bad / qc.QUANT_FILE, "w") as f:
        json.dump({"scheme": "int3", "group": 0, "scale_dtype": "float32"}, f)
    with pytest.raises(CheckpointError, match=r"quantization\.json: not a quantization record"):
        load_checkpoint(bad)
