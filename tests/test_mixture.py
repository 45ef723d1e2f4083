"""Mixtures of packed folders (`data.packed_dir: mix.yaml`, train/data/mixture.py): rows drawn in the
weights' proportions through Grain's mix, the same order under the same seed, exact resume from
the Grain state, the shares printed by `python -m train.data.mixture`, training from a mixture, and
folders that do not belong together refused by name."""

import json
import os

import numpy as np
import pytest
import yaml

from tests.synthetic import train_data as fixtures
from train.data import pipeline as data_lib
from train import main as main_lib
from train.data import mixture
from train.data import pretokenize as pt

SEQ = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mix"))
    paths = fixtures.make_tiny_setup(root, num_docs=40)
    for name, src in (("web", paths["train"]), ("chat", paths["sft"])):
        paths[name] = os.path.join(root, name)
        pt.pretokenize([src], paths["tokenizer"], paths[name], SEQ, shard_rows=7)
    paths["mix"] = os.path.join(root, "mix.yaml")
    with open(paths["mix"], "w") as f:
        yaml.safe_dump({"mixture": [{"dir": paths["web"], "weight": 0.7},
                                    {"dir": paths["chat"], "weight": 0.3}]}, f)
    return paths


def source_of(rows_web, batch_tokens):
    webset = {rows_web["tokens"][i].tobytes() for i in range(len(rows_web["tokens"]))}
    return [t.tobytes() in webset for t in batch_tokens]


def test_mixed_stream_proportions_seed_and_resume(setup):
    meta = data_lib.read_packed_meta(setup["mix"], seq_len=SEQ)
    rows = data_lib.open_packed(setup["mix"], meta)
    web = data_lib.open_packed(setup["web"])
    assert len(rows["tokens"]) == meta["total_rows"] == sum(
        data_lib.read_packed_meta(setup[k])["total_rows"] for k in ("web", "chat"))
    it = iter(data_lib.make_pipeline(rows, 10, 3, first_row=0, local_rows=10))
    batches = [next(it) for _ in range(20)]
    toks = np.concatenate([b["tokens"] for b in batches])
    assert sum(source_of(web, toks)) == 140                      # 70 % of 200 rows
    again = iter(data_lib.make_pipeline(rows, 10, 3, first_row=0, local_rows=10))
    np.testing.assert_array_equal(np.concatenate([next(again)["tokens"] for _ in range(20)]), toks)
    other = iter(data_lib.make_pipeline(rows, 10, 4, first_row=0, local_rows=10))
    assert not np.array_equal(next(other)["tokens"], batches[0]["tokens"])
    # the second process's half of each global batch is the second half of the global rows
    half = iter(data_lib.make_pipeline(rows, 10, 3, first_row=5, local_rows=5))
    np.testing.assert_array_equal(next(half)["tokens"], batches[0]["tokens"][5:])
    # exact resume
    it = iter(data_lib.make_pipeline(rows, 10, 3, first_row=0, local_rows=10))
    for _ in range(7):
        next(it)
    state = it.get_state()
    it2 = iter(data_lib.make_pipeline(rows, 10, 3, first_row=0, local_rows=10))
    it2.set_state(state)
    for b in batches[7:12]:
        np.testing.assert_array_equal(next(it2)["tokens"], b["tokens"])
    # a one-folder mixture is that folder
    one = os.path.join(os.path.dirname(setup["mix"]), "one.json")
    json.dump({"mixture": [{"dir": setup["web"], "weight": 1}]}, open(one, "w"))
    a = iter(data_lib.make_pipeline(data_lib.open_packed(one), 8, 3, first_row=0, local_rows=8))
    b = iter(data_lib.make_pipeline(web, 8, 3, first_row=0, local_rows=8))
    np.testing.assert_array_equal(next(a)["tokens"], next(b)["tokens"])


def test_shares_printed(setup, capsys):
    assert mixture.main([setup["mix"], "--steps", "100", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    meta = data_lib.read_packed_meta(setup["mix"])
    rows = mixture.shares(meta, 100, 8)
    assert [r["row_share"] for r in rows] == pytest.approx([0.7, 0.3])
    tpr = [m["meta"]["tokens"] / m["meta"]["total_rows"] for m in meta["mixture"]]
    want = 0.7 * tpr[0] / (0.7 * tpr[0] + 0.3 * tpr[1])
    assert rows[0]["token_share"] == pytest.approx(want)
    assert rows[0]["epochs"] == pytest.approx(0.7 * 800 / meta["mixture"][0]["meta"]["total_rows"])
    assert "token share" in out and f"{want:.1%}" in out and "70.0%" in out


def test_dry_run_prints_the_mixtures_shares(setup, tmp_path):
    """`wedlm-train --dry-run` on a mixture config prints the shares of the configured steps."""
    from train import dry_run
    from train.config import load_config
    d = fixtures.tiny_config_dict(setup, **{"data.packed_dir": setup["mix"], "steps": 100})
    del d["data"]["train_files"]
    cfg = load_config(fixtures.write_config(str(tmp_path / "c.yaml"), d), [])
    text = dry_run.mixture_shares(cfg)
    meta = data_lib.read_packed_meta(setup["mix"])
    assert text == mixture.format_shares(mixture.shares(meta, 100, cfg.data.global_batch_size))
    assert "70.0%" in text and "epochs" in text
    d["data"]["packed_dir"] = setup["web"]
    assert dry_run.mixture_shares(load_config(fixtures.write_config(str(tmp_path / "p.yaml"),
                                                                    d), [])) is None


def test_train_from_mixture_and_refusals(setup, tmp_path, capsys):
    d = fixtures.tiny_config_dict(setup, **{"data.packed_dir": setup["mix"], "steps": 2,
                                            "checkpoint.dir": str(tmp_path / "run")})
    del d["data"]["train_files"]
    cfg = fixtures.write_config(str(tmp_path / "c.yaml"), d)
    assert main_lib.main(["--config", cfg]) == 0
    assert len(open(tmp_path / "run" / "metrics.jsonl").readlines()) == 2
    capsys.readouterr()
    # folders packed with another tokenizer or seq_len, a bad file: one line naming them
    tok2 = fixtures.train_tokenizer(str(tmp_path / "tok2"), vocab_size=80)
    other = str(tmp_path / "other")
    pt.pretokenize([setup["train"]], tok2, other, SEQ)
    short = str(tmp_path / "short")
    pt.pretokenize([setup["train"]], setup["tokenizer"], short, 16)
    for parts, msg in (([other], "other and .* were packed with a different tokenizer.json"),
                       ([short], "short/meta.json: rows were packed to seq_len 16"),
                       ([str(tmp_path / "none")], "none is not a folder")):
        bad = str(tmp_path / "bad.yaml")
        yaml.safe_dump({"mixture": [{"dir": setup["web"], "weight": 1}] + [
            {"dir": p, "weight": 1} for p in parts]}, open(bad, "w"))
        with pytest.raises(data_lib.DataError, match=msg):
            data_lib.read_packed_meta(bad, seq_len=SEQ)
    yaml.safe_dump({"mixture": [{"dir": setup["web"], "weight": -1}]}, open(bad, "w"))
    with pytest.raises(data_lib.DataError, match=r"mixture\[0\] must be \{dir: FOLDER, weight"):
        data_lib.read_packed_meta(bad)
    # the checkpoint's tokenizer against the mixture's folders
    d["data"]["tokenizer"] = tok2
    d["checkpoint"]["dir"] = str(tmp_path / "run2")
    cfg = fixtures.write_config(str(tmp_path / "c2.yaml"), d)
    assert main_lib.main(["--config", cfg]) == 2
    assert "web/meta.json: the rows were tokenized with a different" in capsys.readouterr().err
