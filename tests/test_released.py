"""The released WeDLM checkpoints' conventions, on tiny stand-ins written here with
the released config.json fields (tests/released.py): `wedlm-decode` runs on a WeDLM-8B-like and a
WeDLM-7B-like folder, Hugging Face and converted, with no extra flag: the [MASK] id of a
`mask_token_id: null` config is 151665 (said once on stderr), `qk_norm` left out is decided by the
q/k-norm tensors, and the default stops are eos, <|im_end|> and <|endoftext|>. The error cases: the
mask id outside the vocabulary, a config that contradicts its tensors."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from decode import cli
from decode.config import DecodeConfig
from decode.static.static_batch import generate
from decode.text import load_tokenizer
from tests.released import QWEN_SPECIALS, qwen_style_tokenizer, released_config, set_config, \
    write_released
from wedlm_jax import convert
from wedlm_jax.config import ConfigError, ModelConfig, released_mask_token_id

EOT, IM_END, MASK = QWEN_SPECIALS["<|endoftext|>"], QWEN_SPECIALS["<|im_end|>"], 151665
PROMPT = "the weather in Paris is"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    return {"8b": write_released(root / "WeDLM-8B", "8b", seed=0),
            "7b": write_released(root / "WeDLM-7B", "7b", seed=1)}


def _decode(capsys, *argv):
    code = cli.main(["--max-new-tokens", "10", "--json", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out), out.err


def _check_against_engine(path, doc, err, prompt_ids):
    """The CLI's result equals the engine given the conventions explicitly."""
    assert err.count("mask_token_id null") == 1 and f"[MASK] id {MASK}" in err
    assert doc["total"]["stop_token_ids"] == [EOT, IM_END]  # eos (= <|endoftext|>), <|im_end|>
    config, params = convert.load_checkpoint(path, progress=False)
    assert config.mask_token_id is None
    # the library door settles the released convention the same way (no mask_token_id given)
    want = generate(params, config, [prompt_ids], DecodeConfig(max_new_tokens=10, stop_token_ids=(EOT, IM_END)))
    row = doc["results"][0]
    assert row["ids"] == want.tokens[0] and len(row["ids"]) >= 1
    return config


def test_wedlm_8b_decodes_with_no_extra_flag(folders, capsys, tmp_path):
    path = folders["8b"]
    ids = load_tokenizer(path).encode(PROMPT)
    doc, err = _decode(capsys, "--checkpoint", path, "--prompt", PROMPT)
    config = _check_against_engine(path, doc, err, ids)
    assert config.qk_norm and not config.qkv_bias and not config.o_bias  # Qwen3-shaped
    assert config.max_position_embeddings == 16384 and config.eos_token_id == EOT
    # converted to Orbax (wedlm-convert, no flag): the same conventions, the same tokens
    out = tmp_path / "orbax"
    assert convert.main(["hf-to-orbax", "--hf", path, "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "wedlm" and written["qk_norm"] is True
    assert written.get("mask_token_id") is None  # still null: the decoder applies the convention
    doc2, err2 = _decode(capsys, "--checkpoint", str(out), "--prompt", PROMPT)
    assert doc2["results"][0]["ids"] == doc["results"][0]["ids"]
    assert err2.count("mask_token_id null") == 1


def test_wedlm_7b_decodes_with_no_extra_flag(folders, capsys):
    path = folders["7b"]
    ids = load_tokenizer(path).encode(PROMPT)
    doc, err = _decode(capsys, "--checkpoint", path, "--prompt", PROMPT, "--window", "4")
    assert err.count("mask_token_id null") == 1
    config, params = convert.load_checkpoint(path, progress=False)
    assert config.qkv_bias and not config.o_bias and not config.qk_norm  # Qwen2.5-shaped
    want = generate(params, config, [ids], DecodeConfig(window=4, max_new_tokens=10,
                                                        stop_token_ids=(EOT, IM_END)), mask_token_id=MASK)
    assert doc["results"][0]["ids"] == want.tokens[0]
    assert doc["total"]["stop_token_ids"] == [EOT, IM_END]


@pytest.mark.parametrize("kind, expect", [("8b", True), ("7b", False)])
def test_qk_norm_left_out_is_decided_by_the_tensors(folders, tmp_path, kind, expect):
    path = shutil.copytree(folders[kind], tmp_path / kind)
    set_config(path, qk_norm=None)
    config, params = convert.load_hf_checkpoint(path, progress=False)
    assert config.qk_norm is expect
    assert ("q_norm" in params["layers"]["attn"]) is expect


def test_config_contradicting_its_tensors_is_named(folders, tmp_path, capsys):
    p8 = shutil.copytree(folders["8b"], tmp_path / "8b")
    set_config(p8, qk_norm=False)
    with pytest.raises(ConfigError, match=r"config\.json: qk_norm is false, but the checkpoint holds "
                                          r"q/k-norm tensors \(model\.layers\.0\.self_attn\.k_norm\.weight, "
                                          r"model\.layers\.0\.self_attn\.q_norm\.weight, .*"
                                          r"model\.layers\.1\.self_attn\.q_norm\.weight\); set qk_norm "
                                          r"to true, or remove the field"):
        convert.load_hf_checkpoint(p8, progress=False)
    code = cli.main(["--checkpoint", str(p8), "--prompt", PROMPT])
    assert code == 2 and "qk_norm is false" in capsys.readouterr().err
    out = tmp_path / "out"
    assert convert.main(["hf-to-orbax", "--hf", str(p8), "--out", str(out), "--no-progress"]) == 2
    assert "qk_norm is false" in capsys.readouterr().err and not out.exists()
    p7 = shutil.copytree(folders["7b"], tmp_path / "7b")
    set_config(p7, qk_norm=True)
    with pytest.raises(ConfigError, match=r"qk_norm is true, but the checkpoint has no q/k-norm tensors"):
        convert.load_hf_checkpoint(p7, progress=False)


def test_mask_id_outside_the_vocabulary(tmp_path, capsys):
    # a config-only folder: every error below comes before any weight is read
    path = qwen_style_tokenizer(tmp_path / "small")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(released_config("7b", vocab_size=MASK), f)
    code = cli.main(["--checkpoint", path, "--prompt", PROMPT])
    err = capsys.readouterr().err
    assert code == 2 and (f"mask_token_id is null, and the vocabulary (vocab_size {MASK}) does not hold "
                          f"{MASK}") in err and "--mask-token-id" in err
    code = cli.main(["--checkpoint", path, "--prompt", PROMPT, "--mask-token-id", str(MASK)])
    assert code == 2 and f"--mask-token-id {MASK} is outside the vocabulary [0, {MASK})" in \
        capsys.readouterr().err
    # the rule itself: only a wedlm config with mask_token_id null takes the released id
    small = ModelConfig.from_hf_dict(released_config("7b", vocab_size=MASK))
    with pytest.raises(ConfigError, match="give the mask token id"):
        released_mask_token_id(small)
    assert released_mask_token_id(ModelConfig.from_hf_dict(released_config("8b"))) == MASK
    assert released_mask_token_id(ModelConfig.from_hf_dict({**released_config("8b"), "mask_token_id": 7})) is None
    assert released_mask_token_id(ModelConfig.from_hf_dict({**released_config("8b"), "model_type": "qwen3"})) is None


def test_training_reads_the_same_conventions(folders, tmp_path):
    """`model.from_hf` on a released-style folder: qk_norm from the tensors, [MASK] 151665 (the rule
    decoding shares), an explicit objective.mask_token_id over it."""
    from train.config import load_config, model_config
    from train.data.pipeline import load_tokenizer, resolve_mask_token_id
    path = shutil.copytree(folders["8b"], tmp_path / "8b")
    set_config(path, qk_norm=None)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": PROMPT}) + "\n")
    base = [f"model.from_hf={path}", f"data.train_files=[{data}]"]
    mc = model_config(load_config(None, base))
    assert mc.qk_norm and resolve_mask_token_id(mc, load_tokenizer(str(path))) == MASK
    given = model_config(load_config(None, base + ["objective.mask_token_id=7"]))
    assert resolve_mask_token_id(given, load_tokenizer(str(path))) == 7


def test_one_mask_rule_for_training_and_decoding():
    """`mask_token_rule`, in order: the config's id, the released id for a `wedlm` config with
    null, the tokenizer's mask token inside the vocabulary, else none; training and the decoding
    door read it through the same function."""
    from decode.config import mask_id_for as decode_mask
    from train.data.pipeline import DataError, resolve_mask_token_id as train_mask
    from wedlm_jax.tokenizer import load_tokenizer as load_tok, mask_token_rule
    demo = os.path.join(os.path.dirname(__file__), "..", "demo", "model")
    tok = load_tok(demo)
    qwen3 = ModelConfig.from_hf(os.path.join(demo, "config.json")).replace(mask_token_id=None)
    assert mask_token_rule(qwen3.replace(mask_token_id=5), tok) == (5, "config")
    assert mask_token_rule(qwen3, tok) == (2, "tokenizer")
    assert mask_token_rule(qwen3, None) == (None, "none")
    assert mask_token_rule(qwen3.replace(vocab_size=2, tie_word_embeddings=True), tok) == (None, "none")
    released = ModelConfig.from_hf_dict(released_config("8b"))
    assert mask_token_rule(released, tok) == (MASK, "released")
    for config in (qwen3, released, qwen3.replace(mask_token_id=5)):
        want = mask_token_rule(config, tok)[0]
        assert train_mask(config, tok) == want
        assert decode_mask(config, None, "streaming", tokenizer=tok) == want
    with pytest.raises(DataError, match="outside the model vocabulary"):
        train_mask(qwen3.replace(vocab_size=2, tie_word_embeddings=True), tok)
