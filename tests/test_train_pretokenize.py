"""The at-scale data path: `python -m train.data.pretokenize` (JSONL -> packed ArrayRecord shards) and
`data.packed_dir` (those rows read into the same Grain pipeline). The packed rows equal the
in-memory packing of the same files (file order), the pipeline yields the same global batches, bad
lines report file:line, the writer holds one shard at a time, a bad folder stops the run before
anything compiles, and wedlm-train trains from a packed folder."""

import json
import os

import numpy as np
import pytest

from train.data import pipeline as data_lib
from tests.synthetic import train_data as fixtures
from train import main as main_lib
from train.data import pretokenize as pt
from train.config import TrainConfigError, load_config

from tests.compiles import COMPILES  # noqa: E402 - every compile (or cache load) here

SEQ = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pretok"))
    paths = fixtures.make_tiny_setup(root, num_docs=40)
    paths["long"] = fixtures.write_jsonl(os.path.join(root, "long.jsonl"), [
        {"text": " ".join(fixtures.sentences(6, seed=9))}, {"text": "the cat sat"}])
    paths["files"] = [paths["train"], paths["sft"], paths["long"]]
    paths["packed"] = os.path.join(root, "packed")
    pt.pretokenize(paths["files"], paths["tokenizer"], paths["packed"], SEQ, shard_rows=5)
    return paths


def _in_memory_rows(setup):
    info = data_lib.load_tokenizer(setup["tokenizer"])
    docs = data_lib.load_documents(setup["files"], info, vocab_size=info.vocab_size)
    return data_lib.pack(docs, SEQ, seed=0, shuffle=False)


def test_packed_rows_equal_in_memory_packing(setup):
    want = _in_memory_rows(setup)
    meta = data_lib.read_packed_meta(setup["packed"], seq_len=SEQ)
    assert meta["total_rows"] == len(want["tokens"]) and meta["rows_per_shard"] == 5
    assert len(meta["shards"]) == -(-len(want["tokens"]) // 5) > 2
    assert meta["max_token_id"] == int(want["tokens"].max()) and meta["skipped_lines"] == 0
    assert meta["tokenizer"]["mask_token_id"] == 1 and meta["lines"] == 82
    rows = data_lib.open_packed(setup["packed"])
    for k in ("tokens", "segment_ids", "maskable"):
        got = np.stack([rows[k][i] for i in range(len(rows[k]))])
        assert got.dtype == want[k].dtype
        np.testing.assert_array_equal(got, want[k])
    # a document longer than a row is cut into row-sized pieces, as in memory
    assert (want["segment_ids"] == 1).sum(axis=1).max() == SEQ
    with pytest.raises(IndexError):
        rows["tokens"][len(rows["tokens"])]


def test_pipeline_over_packed_dir_equals_in_memory(setup):
    mem = _in_memory_rows(setup)
    packed = data_lib.open_packed(setup["packed"])
    for first, local in ((0, 8), (4, 4)):
        a = iter(data_lib.make_pipeline(mem, 8, 3, first_row=first, local_rows=local))
        b = iter(data_lib.make_pipeline(packed, 8, 3, first_row=first, local_rows=local))
        for _ in range(12):  # several epochs of the 17-ish rows
            x, y = next(a), next(b)
            assert x.keys() == y.keys()
            for k in x:
                assert x[k].dtype == y[k].dtype
                np.testing.assert_array_equal(x[k], y[k])
    # exact resume from the Grain state
    it = iter(data_lib.make_pipeline(packed, 8, 3, first_row=0, local_rows=8))
    next(it), next(it)
    state = it.get_state()
    want = [next(it)["tokens"] for _ in range(3)]
    it2 = iter(data_lib.make_pipeline(packed, 8, 3, first_row=0, local_rows=8))
    it2.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(it2)["tokens"], w)


def test_malformed_line_reports_file_line_or_skips(setup, tmp_path, capsys):
    bad = fixtures.write_jsonl(str(tmp_path / "bad.jsonl"), [
        {"text": "the cat"}, "{not json", {"text": 3}, {"text": "a dog"}])
    out = str(tmp_path / "p")
    with pytest.raises(data_lib.DataError, match=r"bad\.jsonl:2: not valid JSON"):
        pt.pretokenize([bad], setup["tokenizer"], out, SEQ)
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["bad.jsonl"]  # no temp left
    rc = pt.main(["--tokenizer", setup["tokenizer"], "--out", out, "--seq-len", str(SEQ), bad])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.jsonl:2: not valid JSON" in err
    assert "(--skip-bad-lines skips such lines)" in err and "data.skip_bad_lines" not in err
    rc = pt.main(["--tokenizer", setup["tokenizer"], "--out", out, "--seq-len", str(SEQ),
                  "--skip-bad-lines", bad])
    assert rc == 0
    meta = data_lib.read_packed_meta(out)
    assert meta["skipped_lines"] == 2 and meta["lines"] == 4
    assert [s.split(": ")[0].rsplit(":", 1)[1] for s in meta["skipped_first"]] == ["2", "3"]
    info = data_lib.load_tokenizer(setup["tokenizer"])
    docs = data_lib.load_documents([bad], info, vocab_size=info.vocab_size, skip_bad_lines=True)
    assert docs.skipped == meta["skipped_first"]
    # an existing output is refused without --force, replaced with it
    rc = pt.main(["--tokenizer", setup["tokenizer"], "--out", out, "--seq-len", "16",
                  "--skip-bad-lines", bad])
    assert rc == 2 and "already holds a packed data folder; pass --force" in capsys.readouterr().err
    assert data_lib.read_packed_meta(out)["seq_len"] == SEQ
    rc = pt.main(["--tokenizer", setup["tokenizer"], "--out", out, "--seq-len", "16",
                  "--skip-bad-lines", "--force", bad])
    assert rc == 0 and data_lib.read_packed_meta(out)["seq_len"] == 16
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "p"]


def test_writer_holds_one_shard(setup, tmp_path, monkeypatch):
    """With --shard-rows 2 every shard is written as soon as it is full: the writer never holds
    more than 2 rows, and shards are on disk while later rows are still being packed."""
    from train.data import arrayrecord
    seen = []
    write = arrayrecord.write_shard

    def spy_write(folder, name, records):
        assert len(records) <= 2
        seen.append(len([f for f in os.listdir(folder) if f.endswith(arrayrecord.SUFFIX)]))
        write(folder, name, records)

    monkeypatch.setattr(arrayrecord, "write_shard", spy_write)
    out = str(tmp_path / "p2")
    meta = pt.pretokenize(setup["files"], setup["tokenizer"], out, SEQ, shard_rows=2)
    n = meta["total_rows"]
    assert seen == list(range(-(-n // 2)))  # shards written incrementally
    shards = sorted(f for f in os.listdir(out) if f.endswith(arrayrecord.SUFFIX))
    assert len(shards) == -(-n // 2) == len(meta["shards"]) > 4
    assert [s["rows"] for s in meta["shards"]] == [2] * (n // 2) + [1] * (n % 2)


def _config(setup, tmp_path, packed_dir, **over):
    d = fixtures.tiny_config_dict(setup, **{"data.packed_dir": packed_dir, "steps": 2,
                                            "peak_flops": 1e9, **over})
    del d["data"]["train_files"]
    return fixtures.write_config(str(tmp_path / "cfg.yaml"), d)


def _main_error(argv, capsys):
    before = len(COMPILES)
    rc = main_lib.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(COMPILES) == before, "compiled something before erroring"
    return err


def test_bad_packed_dir_errors_before_compile(setup, tmp_path, capsys):
    import shutil
    both = fixtures.tiny_config_dict(setup, **{"data.packed_dir": setup["packed"]})
    with pytest.raises(TrainConfigError, match="data.packed_dir and data.train_files are exclusive"):
        load_config(fixtures.write_config(str(tmp_path / "both.yaml"), both))
    neither = fixtures.tiny_config_dict(setup)
    del neither["data"]["train_files"]
    with pytest.raises(TrainConfigError, match="data.train_files is empty.*data.packed_dir"):
        load_config(fixtures.write_config(str(tmp_path / "neither.yaml"), neither))

    err = _main_error(["--config", _config(setup, tmp_path, setup["packed"]), "data.seq_len=64"],
                      capsys)
    assert "meta.json: rows were packed to seq_len 32, but data.seq_len is 64" in err
    err = _main_error(["--config", _config(setup, tmp_path, str(tmp_path / "none"))], capsys)
    assert "is not a folder" in err
    broken = str(tmp_path / "broken")
    shutil.copytree(setup["packed"], broken)
    os.remove(os.path.join(broken, "shard_00000_0001.array_record"))
    err = _main_error(["--config", _config(setup, tmp_path, broken)], capsys)
    assert "shard_00000_0001.array_record: missing (listed in" in err
    with open(os.path.join(broken, "shard_00000_0001.array_record"), "wb") as f:
        f.write(b"not an array record")
    err = _main_error(["--config", _config(setup, tmp_path, broken)], capsys)
    assert "shard_00000_0001.array_record: unreadable as ArrayRecord" in err
    os.remove(os.path.join(broken, "meta.json"))
    err = _main_error(["--config", _config(setup, tmp_path, broken)], capsys)
    assert "meta.json: missing" in err
    # rows from another tokenizer, or ids past the model's vocabulary
    other = fixtures.train_tokenizer(str(tmp_path / "tok2"), vocab_size=80)
    err = _main_error(["--config", _config(setup, tmp_path, setup["packed"],
                                           **{"data.tokenizer": other})], capsys)
    assert "tokenized with a different tokenizer.json" in err
    small = dict(fixtures.TINY_MODEL, vocab_size=40)
    err = _main_error(["--config", _config(setup, tmp_path, setup["packed"],
                                           **{"model.config": small})], capsys)
    assert "meta.json: token id" in err and "outside the model vocabulary [0, 40)" in err


def test_wedlm_train_from_packed_dir(setup, tmp_path, capsys):
    path = _config(setup, tmp_path, setup["packed"])
    cfg = load_config(path)
    prep = main_lib.prepare(cfg)
    assert len(prep["rows"]["tokens"]) == data_lib.read_packed_meta(setup["packed"])["total_rows"]
    assert main_lib.main(["--config", path, f"metrics_file={tmp_path / 'm.jsonl'}"]) == 0
    assert "wedlm-train: step 2 loss" in capsys.readouterr().out
    recs = [json.loads(l) for l in open(tmp_path / "m.jsonl")]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["tokens"] > 0 for r in recs)
