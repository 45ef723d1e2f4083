"""Checkpoint conversion: HF safetensors <-> JAX params <-> Orbax, the wedlm-convert CLI, and
every bad input the issue names. Tiny random transformers models, float32.

Independent references: transformers' own forward (logits), transformers' own safetensors
writer/reader (`save_pretrained`, `from_pretrained`, `safetensors.numpy.load_file`) and torch's
bfloat16 cast."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from wedlm_jax import checkpoints, convert, model as model_lib
from wedlm_jax.checkpoints import hf
from wedlm_jax import safetensors_io as st
from wedlm_jax.config import ConfigError
from tests import xla

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
TOKENIZER_STUBS = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}',
                   "tokenizer_config.json": '{"model_max_length": 128}',
                   "generation_config.json": '{"do_sample": false}'}


def build_hf(kind: str, folder, seed: int = 0):
    """A tiny random transformers model saved to `folder` (with stand-in tokenizer files); every
    weight, norm scales and biases included, drawn at random so no layout error can hide."""
    torch.manual_seed(seed)
    if kind == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False))
    elif kind == "qwen3":  # head_dim 16 != hidden / heads = 8, untied head
        m = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False))
    else:
        m = LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=True))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    m.eval().save_pretrained(folder)
    for name, text in TOKENIZER_STUBS.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return m


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("qwen2", "qwen3", "llama"):
        folder = str(root / kind)
        out[kind] = (folder, build_hf(kind, folder))
    return out


def tokens_positions(batch=2, seq=11, seed=1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (batch, seq))
    return tokens, np.broadcast_to(np.arange(seq), (batch, seq))


def hf_logits(m, tokens):
    with torch.no_grad():
        return m(torch.as_tensor(tokens)).logits.float().numpy()


def jax_logits(config, params, tokens, positions):
    return np.asarray(model_lib.Transformer(config).apply({"params": params}, tokens, positions))


def assert_trees_equal(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (k, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype, k
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(k)


def folder_digest(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def copy_hf(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def rewrite_tensors(folder, edit):
    """Rewrite `folder/model.safetensors` through `edit(dict of numpy arrays)`."""
    path = os.path.join(folder, "model.safetensors")
    tensors = safetensors.numpy.load_file(path)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def edit_config(folder, **fields):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        d = json.load(f)
    d.update(fields)
    with open(path, "w") as f:
        json.dump(d, f)


# --------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_round_trip_bit_exact_and_loads_in_transformers(hf_models, tmp_path, kind):
    folder, hf_model = hf_models[kind]
    config, params = convert.load_hf_checkpoint(folder, progress=False)
    assert config.model_type == kind
    assert config.qkv_bias == (kind == "qwen2") and config.qk_norm == (kind == "qwen3")
    assert config.tie_word_embeddings == (kind == "llama") and ("lm_head" in params) == (kind != "llama")
    tokens, positions = tokens_positions()
    ref = hf_logits(hf_model, tokens)
    assert np.abs(jax_logits(config, params, tokens, positions) - ref).max() <= 1e-4

    out = str(tmp_path / "export")
    convert.save_hf_checkpoint(config, params, out, tokenizer_from=folder, progress=False)
    # Every exported tensor equals transformers' own tensor, read by the safetensors library.
    original = safetensors.numpy.load_file(os.path.join(folder, "model.safetensors"))
    exported = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported) == sorted(n for n in original if n != "lm_head.weight" or kind != "llama")
    for name, arr in exported.items():
        assert arr.dtype == np.float32 and np.array_equal(arr, original[name]), name
    for name, text in TOKENIZER_STUBS.items():
        with open(os.path.join(out, name)) as f:
            assert f.read() == text

    config2, params2 = convert.load_hf_checkpoint(out, progress=False)
    assert config2 == config
    assert_trees_equal(params, params2)

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf_model)
    assert np.abs(hf_logits(reloaded, tokens) - ref).max() <= 1e-6


def test_sharded_safetensors_with_index(hf_models, tmp_path):
    folder, hf_model = hf_models["qwen3"]
    config, params = convert.load_hf_checkpoint(folder, progress=False)
    out = str(tmp_path / "sharded")
    convert.save_hf_checkpoint(config, params, out, max_shard_size="20KB", progress=False)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and "model.safetensors" not in files
    with open(os.path.join(out, st.INDEX_NAME)) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(files)
    for fname in files:  # each shard respects the limit unless it holds one oversized tensor
        n = len(safetensors.numpy.load_file(os.path.join(out, fname)))
        assert n == 1 or os.path.getsize(os.path.join(out, fname)) <= 20_000 + 4096
    _, params2 = convert.load_hf_checkpoint(out, progress=False)
    assert_trees_equal(params, params2)
    # transformers reads our sharded folder, and we read transformers' sharded folder.
    tokens, _ = tokens_positions()
    assert np.abs(hf_logits(AutoModelForCausalLM.from_pretrained(out), tokens)
                  - hf_logits(hf_model, tokens)).max() <= 1e-6
    theirs = str(tmp_path / "theirs")
    hf_model.save_pretrained(theirs, max_shard_size="30KB")
    assert os.path.exists(os.path.join(theirs, st.INDEX_NAME))
    _, params3 = convert.load_hf_checkpoint(theirs, progress=False)
    assert_trees_equal(params, params3)
    # Without an index, any set of *.safetensors files is accepted.
    os.remove(os.path.join(out, st.INDEX_NAME))
    _, params4 = convert.load_hf_checkpoint(out, progress=False)
    assert_trees_equal(params, params4)


def test_orbax_save_load_and_detection(hf_models, tmp_path):
    folder, _ = hf_models["qwen2"]
    config, params = convert.load_hf_checkpoint(folder, progress=False)
    out = str(tmp_path / "orbax")
    convert.save_orbax(config, params, out, tokenizer_from=folder)
    assert {"config.json", "params", *TOKENIZER_STUBS} <= set(os.listdir(out))
    config2, params2 = convert.load_orbax(out)
    assert config2 == config
    assert_trees_equal(params, params2)
    assert checkpoints.checkpoint_kind(out) == "orbax" and checkpoints.checkpoint_kind(folder) == "hf"
    _, params3 = convert.load_checkpoint(out)
    assert_trees_equal(params, params3)
    _, params4 = convert.load_checkpoint(folder, progress=False)
    assert_trees_equal(params, params4)
    _, p16 = convert.load_orbax(out, dtype="bf16")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p16)):
        assert b.dtype == ml_dtypes.bfloat16
        assert np.array_equal(np.asarray(b), np.asarray(a).astype(ml_dtypes.bfloat16))


def test_layers_loaded_one_tree_each(hf_models, tmp_path):
    """`stacked_layers=False` (GPU decoding's weights): both loaders give `unstack_layers` of the
    stacked tree, the same values, in the tree of `unstack_layers(param_shapes)`."""
    folder, _ = hf_models["qwen3"]
    config, params = convert.load_hf_checkpoint(folder, progress=False)
    out = str(tmp_path / "orbax")
    convert.save_orbax(config, params, out)
    want = model_lib.unstack_layers(params, config.num_layers)
    shapes = model_lib.unstack_layers(model_lib.param_shapes(config), config.num_layers)
    for loaded in (convert.load_hf_checkpoint(folder, progress=False, stacked_layers=False)[1],
                   convert.load_orbax(out, stacked_layers=False)[1],
                   convert.load_checkpoint(out, stacked_layers=False)[1]):
        assert not model_lib.layers_stacked(loaded)
        assert jax.tree.structure(loaded) == jax.tree.structure(shapes)
        assert_trees_equal(want, loaded)


def test_bf16_conversion(hf_models, tmp_path):
    folder, hf_model = hf_models["qwen3"]
    config, p32 = convert.load_hf_checkpoint(folder, progress=False)
    _, p16 = convert.load_hf_checkpoint(folder, dtype="bf16", progress=False)
    for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
        assert b.dtype == ml_dtypes.bfloat16
        assert np.array_equal(np.asarray(b), np.asarray(a).astype(ml_dtypes.bfloat16))
    # Exported bf16 tensors are bit-identical to torch's own bfloat16 cast of the weights.
    out = str(tmp_path / "bf16")
    convert.save_hf_checkpoint(config, p32, out, dtype="bf16", progress=False)
    from safetensors import safe_open
    state = hf_model.state_dict()
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            got = f.get_tensor(name)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), state[name].bfloat16().view(torch.int16)), name
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    # A bf16 checkpoint written by transformers reads back to the same bits.
    theirs = str(tmp_path / "theirs_bf16")
    hf_model.to(torch.bfloat16).save_pretrained(theirs)
    hf_model.to(torch.float32)
    _, q16 = convert.load_hf_checkpoint(theirs, progress=False)
    assert_trees_equal(p16, q16)
    _, q32 = convert.load_hf_checkpoint(theirs, dtype="f32", progress=False)
    for a, b in zip(jax.tree.leaves(q16), jax.tree.leaves(q32)):
        assert b.dtype == np.float32 and np.array_equal(np.asarray(a).astype(np.float32), np.asarray(b))


def test_cli_end_to_end(hf_models, tmp_path):
    folder, _ = hf_models["llama"]
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")
    assert convert.main(["hf-to-orbax", "--hf", folder, "--out", orbax_dir, "--no-progress"]) == 0
    assert convert.main(["orbax-to-hf", "--orbax", orbax_dir, "--out", back, "--no-progress",
                         "--max-shard-size", "16KB"]) == 0
    assert os.path.exists(os.path.join(back, st.INDEX_NAME))
    assert set(TOKENIZER_STUBS) <= set(os.listdir(back))
    _, p_src = convert.load_hf_checkpoint(folder, progress=False)
    _, p_back = convert.load_hf_checkpoint(back, progress=False)
    assert_trees_equal(p_src, p_back)
    b16 = str(tmp_path / "orbax16")
    assert convert.main(["hf-to-orbax", "--hf", folder, "--out", b16, "--dtype", "bf16",
                         "--no-progress"]) == 0
    _, p16 = convert.load_orbax(b16)
    assert all(x.dtype == ml_dtypes.bfloat16 for x in jax.tree.leaves(p16))


def test_cli_round_trip_keeps_the_config_and_the_bytes_and_follows_the_umask(hf_models, tmp_path):
    """HF -> Orbax -> HF of an unmodified transformers checkpoint (one safetensors file): every
    file byte-identical to the source (config.json with every field transformers wrote, the
    safetensors file laid out as the safetensors library lays it out, the tokenizer files); the
    folders made with the umask's mode, not mkdtemp's 0700. A config the conversion does change
    (--dtype) keeps every other field."""
    folder, _ = hf_models["qwen3"]
    src = json.load(open(os.path.join(folder, "config.json")))
    assert {"initializer_range", "layer_types", "sliding_window", "max_window_layers",
            "use_sliding_window", "bos_token_id", "eos_token_id"} <= set(src)
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")
    old = os.umask(0o022)
    try:
        assert convert.main(["hf-to-orbax", "--hf", folder, "--out", orbax_dir, "--no-progress"]) == 0
        assert convert.main(["orbax-to-hf", "--orbax", orbax_dir, "--out", back, "--no-progress"]) == 0
        os.umask(0o027)
        b16 = str(tmp_path / "back16")
        assert convert.main(["orbax-to-hf", "--orbax", orbax_dir, "--out", b16, "--dtype", "bf16",
                             "--no-progress"]) == 0
    finally:
        os.umask(old)
    assert os.stat(orbax_dir).st_mode & 0o777 == os.stat(back).st_mode & 0o777 == 0o755
    assert os.stat(b16).st_mode & 0o777 == 0o750
    assert sorted(os.listdir(back)) == sorted(os.listdir(folder))
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as a, open(os.path.join(back, name), "rb") as b:
            assert a.read() == b.read(), name
    got = json.load(open(os.path.join(b16, "config.json")))
    assert got == dict(src, dtype="bfloat16") and list(got)[:len(src)] == list(src)


def test_cli_user_error_is_one_line_exit_2(tmp_path):
    folder = tmp_path / "pickles"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", **COMMON}))
    (folder / "pytorch_model.bin").write_bytes(b"\x00not a pickle")
    r = subprocess.run([sys.executable, "-m", "wedlm_jax.convert", "hf-to-orbax", "--hf", str(folder),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.startswith("wedlm-convert: error:")]
    assert len(lines) == 1 and "pytorch_model.bin" in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- bad input

def test_wrong_folder_kinds(hf_models, tmp_path, capsys):
    folder = hf_models["qwen3"][0]
    with pytest.raises(convert.CheckpointError, match=r"no params/ folder"):
        convert.load_orbax(folder)
    with pytest.raises(convert.CheckpointError, match=r"not a folder"):
        convert.load_hf_checkpoint(str(tmp_path / "nowhere"), progress=False)
    before = folder_digest(folder)
    assert convert.main(["hf-to-orbax", "--hf", folder, "--out", folder, "--force",
                         "--no-progress"]) == 2
    assert "output folder is the input folder" in capsys.readouterr().err
    assert folder_digest(folder) == before
    assert convert.main(["orbax-to-hf", "--orbax", str(tmp_path), "--out", str(tmp_path / "o"),
                         "--max-shard-size", "lots"]) == 2
    assert "max_shard_size 'lots'" in capsys.readouterr().err


def test_missing_tensor(hf_models, tmp_path):
    folder = copy_hf(hf_models["qwen3"][0], tmp_path / "m")
    rewrite_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(convert.CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        convert.load_hf_checkpoint(folder, progress=False)


def test_extra_tensor_refused_unless_allowed(hf_models, tmp_path):
    src = hf_models["qwen2"][0]
    folder = copy_hf(src, tmp_path / "x")
    rewrite_tensors(folder, lambda t: t.update({
        "model.layers.0.self_attn.rel_bias.weight": np.ones((4,), np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones((4,), np.float32)}))
    with pytest.raises(convert.CheckpointError) as e:
        convert.load_hf_checkpoint(folder, progress=False)
    msg = str(e.value)
    assert "model.layers.0.self_attn.rel_bias.weight" in msg and "allow-extra" in msg
    assert "inv_freq" not in msg  # a known buffer is always skipped
    _, params = convert.load_hf_checkpoint(folder, allow_extra=True, progress=False)
    _, ref = convert.load_hf_checkpoint(src, progress=False)
    assert_trees_equal(ref, params)
    assert convert.main(["hf-to-orbax", "--hf", folder, "--out", str(tmp_path / "o1"),
                         "--no-progress"]) == 2
    assert not (tmp_path / "o1").exists()
    assert convert.main(["hf-to-orbax", "--hf", folder, "--out", str(tmp_path / "o2"),
                         "--allow-extra", "--no-progress"]) == 0


def test_tied_model_tolerates_lm_head(hf_models, tmp_path):
    src = hf_models["llama"][0]
    folder = copy_hf(src, tmp_path / "tied")
    rewrite_tensors(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    _, params = convert.load_hf_checkpoint(folder, progress=False)
    _, ref = convert.load_hf_checkpoint(src, progress=False)
    assert "lm_head" not in params
    assert_trees_equal(ref, params)


def test_shape_mismatch_names_both_shapes(hf_models, tmp_path):
    folder = copy_hf(hf_models["qwen3"][0], tmp_path / "s")
    rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                                np.zeros((24, 32), np.float32)}))
    with pytest.raises(convert.CheckpointError) as e:
        convert.load_hf_checkpoint(folder, progress=False)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "[24, 32]" in msg and "[32, 32]" in msg


def test_shape_check_happens_before_any_tensor_is_read(hf_models, tmp_path, monkeypatch):
    folder = copy_hf(hf_models["qwen3"][0], tmp_path / "s")
    rewrite_tensors(folder, lambda t: t.update({"model.norm.weight": np.zeros((31,), np.float32)}))
    reads = []
    monkeypatch.setattr(st, "read_tensor", lambda info: reads.append(info.name))
    with pytest.raises(convert.CheckpointError, match=r"model\.norm\.weight has shape \[31\].*needs \[32\]"):
        convert.load_hf_checkpoint(folder, progress=False)
    assert reads == []


@pytest.mark.parametrize("field,value,pattern", [
    ("model_type", "mistral", r"model_type 'mistral' is not supported; supported: qwen2, qwen3, llama, wedlm"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
     r"RoPE type 'dynamic' is not supported; supported: default, linear, llama3, yarn"),
    ("mask_token_id", VOCAB, rf"mask_token_id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
])
def test_bad_config_fields(hf_models, tmp_path, capsys, field, value, pattern):
    folder = copy_hf(hf_models["qwen3"][0], tmp_path / "c")
    edit_config(folder, **{field: value})
    with pytest.raises(ConfigError, match=pattern):
        convert.load_hf_checkpoint(folder, progress=False)
    assert convert.main(["hf-to-orbax", "--hf", folder, "--out", str(tmp_path / "o"),
                         "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and field.split("_")[0].lower() in err.lower()
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("filename", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_only_folder_refused_without_unpickling(hf_models, tmp_path, filename):
    folder = tmp_path / "pk"
    folder.mkdir()
    shutil.copy(os.path.join(hf_models["qwen3"][0], "config.json"), folder)
    marker = tmp_path / "UNPICKLED"

    class Payload:  # unpickling this would create `marker`
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (folder / filename).write_bytes(pickle.dumps(Payload()))
    with pytest.raises(convert.CheckpointError, match=rf"only PyTorch pickle files \({filename}\).*never unpickled"):
        convert.load_hf_checkpoint(str(folder), progress=False)
    assert not marker.exists()
    pickle.loads((folder / filename).read_bytes())  # the payload is live: unpickling does fire
    assert marker.exists()


def test_truncated_safetensors_named_before_reading(hf_models, tmp_path):
    folder = copy_hf(hf_models["qwen3"][0], tmp_path / "t")
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(convert.CheckpointError, match=r"model\.safetensors: tensor '.*' .*inconsistent"):
        convert.load_hf_checkpoint(folder, progress=False)


def test_existing_output_needs_force(hf_models, tmp_path):
    out = str(tmp_path / "orbax")
    folder_a, folder_b = hf_models["qwen3"][0], str(tmp_path / "b")
    build_hf("qwen3", folder_b, seed=7)
    assert convert.main(["hf-to-orbax", "--hf", folder_a, "--out", out, "--no-progress"]) == 0
    before = folder_digest(out)
    assert convert.main(["hf-to-orbax", "--hf", folder_b, "--out", out, "--no-progress"]) == 2
    assert folder_digest(out) == before
    with pytest.raises(convert.CheckpointError, match="already holds a checkpoint"):
        convert.save_hf_checkpoint(*convert.load_hf_checkpoint(folder_b, progress=False), out,
                                   progress=False)
    assert folder_digest(out) == before
    assert convert.main(["hf-to-orbax", "--hf", folder_b, "--out", out, "--force", "--no-progress"]) == 0
    _, got = convert.load_orbax(out)
    _, want = convert.load_hf_checkpoint(folder_b, progress=False)
    assert_trees_equal(want, got)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    # A non-empty folder that is not a checkpoint is never replaced, even with force.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert convert.main(["hf-to-orbax", "--hf", folder_b, "--out", str(other), "--force",
                         "--no-progress"]) == 2
    assert (other / "keep.txt").read_text() == "mine"


def _leftovers(parent):
    return [n for n in os.listdir(parent) if n.startswith(".")]


def test_interrupted_read_leaves_nothing_and_keeps_old(hf_models, tmp_path, monkeypatch):
    folder = hf_models["qwen2"][0]
    out = str(tmp_path / "orbax")
    assert convert.main(["hf-to-orbax", "--hf", hf_models["qwen3"][0], "--out", out,
                         "--no-progress"]) == 0
    before = folder_digest(out)
    real, calls = st.read_tensor, []

    def failing_read(info):
        calls.append(info.name)
        if len(calls) == 5:
            raise OSError("disk vanished mid-way")
        return real(info)

    monkeypatch.setattr(st, "read_tensor", failing_read)
    with pytest.raises(OSError, match="mid-way"):
        convert.main(["hf-to-orbax", "--hf", folder, "--out", out, "--force", "--no-progress"])
    assert folder_digest(out) == before and _leftovers(tmp_path) == []
    fresh = str(tmp_path / "fresh")
    calls.clear()
    with pytest.raises(OSError, match="mid-way"):
        convert.main(["hf-to-orbax", "--hf", folder, "--out", fresh, "--no-progress"])
    assert not os.path.exists(fresh) and _leftovers(tmp_path) == []


def test_interrupted_write_leaves_nothing_and_keeps_old(hf_models, tmp_path, monkeypatch):
    config, params = convert.load_hf_checkpoint(hf_models["qwen3"][0], progress=False)
    out = str(tmp_path / "hf")
    convert.save_hf_checkpoint(config, params, out, progress=False)
    before = folder_digest(out)
    real, calls = hf.to_host, []

    def failing_gather(x):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("device lost mid-way")
        return real(x)

    monkeypatch.setattr(hf, "to_host", failing_gather)
    with pytest.raises(RuntimeError, match="mid-way"):
        convert.save_hf_checkpoint(config, params, out, force=True, max_shard_size="10KB",
                                   progress=False)
    assert len(calls) == 6 and folder_digest(out) == before and _leftovers(tmp_path) == []


def test_killed_write_leaves_no_complete_looking_folder(hf_models, tmp_path):
    """A hard kill (os._exit: no cleanup runs) mid-write leaves only a hidden partial folder
    without config.json, and a pre-existing checkpoint intact."""
    src, out = hf_models["qwen3"][0], str(tmp_path / "hf")
    script = textwrap.dedent(f"""
        import os
        from wedlm_jax import convert
        from wedlm_jax.checkpoints import hf
        config, params = convert.load_hf_checkpoint({src!r}, progress=False)
        convert.save_hf_checkpoint(config, params, {out!r}, progress=False)
        real, n = hf.to_host, []
        def dying(x):
            n.append(1)
            if len(n) == 6:
                os._exit(9)
            return real(x)
        hf.to_host = dying
        convert.save_hf_checkpoint(config, params, {out!r}, force=True, max_shard_size="10KB",
                                   tokenizer_from={src!r}, progress=False)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    _, got = convert.load_hf_checkpoint(out, progress=False)
    _, want = convert.load_hf_checkpoint(src, progress=False)
    assert_trees_equal(want, got)
    partial = _leftovers(tmp_path)
    assert len(partial) == 1 and ".partial-" in partial[0]
    assert "config.json" not in os.listdir(tmp_path / partial[0])
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path / partial[0]))


# --------------------------------------------------------------------------- mesh

def test_load_onto_mesh_8_devices(hf_models, tmp_path):
    folder = hf_models["qwen3"][0]
    orbax_dir = str(tmp_path / "orbax")
    convert.save_orbax(*convert.load_hf_checkpoint(folder, progress=False), orbax_dir)
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from wedlm_jax import convert, model, sharding
        assert jax.device_count() == 8
        mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
        config, ref = convert.load_hf_checkpoint({folder!r}, progress=False)
        axes = model.param_logical_axes(config)
        n_split = 0
        for loader in (lambda: convert.load_hf_checkpoint({folder!r}, mesh=mesh, progress=False),
                       lambda: convert.load_orbax({orbax_dir!r}, mesh=mesh)):
            _, params = loader()
            flat = jax.tree_util.tree_leaves_with_path(params)
            assert len(flat) == len(jax.tree.leaves(ref))
            for path, x in flat:
                name = jax.tree_util.keystr(path)
                node_axes = axes
                for k in path:
                    node_axes = node_axes[k.key]
                spec = sharding.spec_for(node_axes, x.shape, mesh)
                assert x.sharding.mesh == mesh and x.sharding.spec == spec, (name, x.sharding.spec, spec)
                ref_x = ref
                for k in path:
                    ref_x = ref_x[k.key]
                assert np.array_equal(np.asarray(x), np.asarray(ref_x)), name
                shard_shape = x.sharding.shard_shape(x.shape)
                for s in x.addressable_shards:
                    assert s.data.shape == shard_shape, name
                    assert np.array_equal(np.asarray(s.data), np.asarray(ref_x)[s.index]), name
                n_split += shard_shape != x.shape
            # Export straight from the sharded arrays: the files equal the original ones.
            out = {str(tmp_path)!r} + "/export_" + str(n_split)
            convert.save_hf_checkpoint(config, params, out, max_shard_size="30KB", progress=False)
            _, back = convert.load_hf_checkpoint(out, progress=False)
            for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(back)):
                assert np.array_equal(np.asarray(a), np.asarray(b))
        per_layer_axes = model.unstack_layers(axes, config.num_layers)
        per_layer_ref = model.unstack_layers(ref, config.num_layers)
        for loader in (lambda: convert.load_hf_checkpoint({folder!r}, mesh=mesh, progress=False,
                                                          stacked_layers=False),
                       lambda: convert.load_orbax({orbax_dir!r}, mesh=mesh, stacked_layers=False)):
            _, params = loader()
            for path, x in jax.tree_util.tree_leaves_with_path(params):
                node_axes, ref_x = per_layer_axes, per_layer_ref
                for k in path:
                    node_axes, ref_x = node_axes[k.key], ref_x[k.key]
                want = jax.sharding.NamedSharding(mesh, sharding.spec_for(node_axes, x.shape, mesh))
                assert x.sharding.is_equivalent_to(want, x.ndim), (path, x.sharding, want)
                assert np.array_equal(np.asarray(x), np.asarray(ref_x)), path
        print("SPLIT", n_split)
    """)
    env = dict(os.environ, XLA_FLAGS=xla.flags(8), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    n_split = int(r.stdout.split("SPLIT")[-1])
    # every matrix really is split across devices: embedding, head, q/k/v/o and gate/up/down
    # (stacked over the layers), 9 per loader
    assert n_split >= 18
