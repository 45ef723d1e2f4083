"""`python -m train.data.pretokenize` inputs and output folder: JSONL, JSONL.gz/.zst and Parquet (whole
rows, a text column, a messages column) given as files, folders or globs pack into the same rows
as the same records in plain JSONL; bad records are named `file:line` / `file:row N` or skipped;
the rows do not depend on the number of worker processes; a rerun keeps the finished units; a
half-written folder is never read as data and is refused by name."""

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.synthetic import train_data as fixtures
from train.data import pipeline as data_lib
from train.data import pretokenize as pt

SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    paths = fixtures.make_tiny_setup(str(root), num_docs=30)
    texts = [json.loads(x) for x in open(paths["train"])]
    chats = [json.loads(x) for x in open(paths["sft"])]
    chats = [c for c in chats if "messages" in c]
    d = root / "corpus"
    d.mkdir()
    raw = "".join(json.dumps(r) + "\n" for r in texts[:10]).encode()
    (d / "a.jsonl").write_bytes(raw)
    (d / "b.jsonl.gz").write_bytes(gzip.compress("".join(
        json.dumps(r) + "\n" for r in texts[10:20]).encode()))
    (d / "c.jsonl.zst").write_bytes(pa.compress("".join(
        json.dumps(r) + "\n" for r in texts[20:]).encode(), "zstd", asbytes=True))
    pq.write_table(pa.table({"body": [r["text"] for r in texts[:12]]}), d / "d.parquet",
                   row_group_size=5)
    pq.write_table(pa.table({"conv": [c["messages"] for c in chats]}), root / "chat.parquet")
    plain = fixtures.write_jsonl(str(root / "plain.jsonl"), texts + texts[:12])
    chat_jsonl = fixtures.write_jsonl(str(root / "chat.jsonl"), chats)
    return dict(paths, root=str(root), dir=str(d), plain=plain, chat_jsonl=chat_jsonl,
                chat_parquet=str(root / "chat.parquet"))


def rows_of(folder):
    rows = data_lib.open_packed(folder)
    return {k: np.stack([rows[k][i] for i in range(len(rows[k]))]) for k in rows}


def assert_same_rows(a, b):
    x, y = rows_of(a), rows_of(b)
    for k in x:
        np.testing.assert_array_equal(x[k], y[k])


def test_formats_and_folder_give_the_rows_of_plain_jsonl(corpus, tmp_path):
    tok = corpus["tokenizer"]
    want = pt.pretokenize([corpus["plain"]], tok, str(tmp_path / "want"), SEQ, shard_rows=4)
    got = pt.pretokenize([corpus["dir"]], tok, str(tmp_path / "got"), SEQ, shard_rows=4,
                         text_column="body")
    assert [f["path"].rsplit("/", 1)[1] for f in got["source_files"]] == [
        "a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"]
    assert all(f["size"] == os.path.getsize(f["path"]) for f in got["source_files"])
    assert got["total_rows"] == want["total_rows"] and got["tokens"] == want["tokens"] > 0
    assert_same_rows(str(tmp_path / "want"), str(tmp_path / "got"))
    # a glob names the same files
    pt.pretokenize([os.path.join(corpus["dir"], "*.jsonl*"), os.path.join(corpus["dir"], "d.*")],
                   tok, str(tmp_path / "glob"), SEQ, shard_rows=4, text_column="body")
    assert_same_rows(str(tmp_path / "want"), str(tmp_path / "glob"))
    # the messages column of a Parquet file: the rows of the same conversations in JSONL
    pt.pretokenize([corpus["chat_jsonl"]], tok, str(tmp_path / "cj"), SEQ)
    pt.pretokenize([corpus["chat_parquet"]], tok, str(tmp_path / "cp"), SEQ,
                   messages_column="conv")
    assert_same_rows(str(tmp_path / "cj"), str(tmp_path / "cp"))
    assert rows_of(str(tmp_path / "cp"))["maskable"].sum() < (rows_of(str(tmp_path / "cp"))[
        "segment_ids"] > 0).sum()          # only the assistant turns are maskable


def test_bad_records_are_named_or_skipped(corpus, tmp_path, capsys):
    tok = corpus["tokenizer"]
    pq.write_table(pa.table({"text": ["the cat", None, "a dog"]}), tmp_path / "bad.parquet")
    out = str(tmp_path / "o")
    rc = pt.main(["--tokenizer", tok, "--out", out, "--seq-len", str(SEQ),
                  str(tmp_path / "bad.parquet")])
    assert rc == 2 and "bad.parquet:row 2: no 'text', 'prompt'/'response' or 'messages' field" in capsys.readouterr().err
    assert not os.path.exists(out)
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n{oops\n'))
    rc = pt.main(["--tokenizer", tok, "--out", out, "--seq-len", str(SEQ), "--skip-bad-lines",
                  str(tmp_path / "bad.parquet"), str(tmp_path / "bad.jsonl.gz")])
    assert rc == 0
    meta = data_lib.read_packed_meta(out)
    assert meta["skipped_lines"] == 2 and meta["lines"] == 5
    assert meta["skipped_first"][1].startswith(f"{tmp_path}/bad.jsonl.gz:2: not valid JSON")
    for args, msg in (([str(tmp_path / "none.jsonl")], "none.jsonl: does not exist"),
                      ([str(tmp_path / "*.csv")], "matches no file"),
                      ([corpus["chat_parquet"], "--text-column", "text"], "no column 'text'")):
        rc = pt.main(["--tokenizer", tok, "--out", str(tmp_path / "x"), "--seq-len", "8", *args])
        assert rc == 2 and msg in capsys.readouterr().err


def test_rows_do_not_depend_on_workers_and_rerun_resumes(corpus, tmp_path, monkeypatch):
    tok, files = corpus["tokenizer"], [corpus["dir"]]
    kw = dict(shard_rows=3, unit_bytes=400, text_column="body")
    one = pt.pretokenize(files, tok, str(tmp_path / "one"), SEQ, **kw)
    assert one["units"] >= 4
    two = pt.pretokenize(files, tok, str(tmp_path / "two"), SEQ, workers=2, **kw)
    assert one["shards"] == two["shards"]
    assert_same_rows(str(tmp_path / "one"), str(tmp_path / "two"))
    # a run that dies after two units: no meta.json, refused by name; the rerun keeps them
    out = str(tmp_path / "resumed")
    calls = []
    pack = pt.pack_unit

    def dying(job, k, pieces):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(k)
        return pack(job, k, pieces)

    monkeypatch.setattr(pt, "pack_unit", dying)
    with pytest.raises(KeyboardInterrupt):
        pt.pretokenize(files, tok, out, SEQ, **kw)
    assert not os.path.exists(os.path.join(out, "meta.json"))
    with pytest.raises(data_lib.DataError, match="meta.json: missing .an unfinished"):
        data_lib.read_packed_meta(out)
    with pytest.raises(data_lib.DataError, match="unfinished run of other inputs or settings "
                                                 r"\(different seq_len\)"):
        pt.pretokenize(files, tok, out, 16, **kw)
    monkeypatch.setattr(pt, "pack_unit", lambda job, k, pieces: calls.append(k) or pack(
        job, k, pieces))
    pt.pretokenize(files, tok, out, SEQ, **kw)
    assert calls == list(range(one["units"]))      # units 0, 1 kept, the rest packed once
    assert_same_rows(str(tmp_path / "one"), out)
    with pytest.raises(data_lib.DataError, match="already holds a packed data folder"):
        pt.pretokenize(files, tok, out, SEQ, **kw)


def test_uri_inputs_and_output_take_the_remote_path(corpus, tmp_path):
    """Inputs and the output folder given as URIs (`file://`: the branch gs:// and s3:// take,
    pyarrow's filesystem for listing and reading, shards written locally then uploaded to a
    temporary name and moved) give the rows of the same local run."""
    tok = corpus["tokenizer"]
    pt.pretokenize([corpus["dir"]], tok, str(tmp_path / "local"), SEQ, shard_rows=4,
                   text_column="body")
    meta = pt.pretokenize(["file://" + corpus["dir"]], tok, "file://" + str(tmp_path / "remote"),
                          SEQ, shard_rows=4, text_column="body")
    assert all(f["path"].startswith("file://") for f in meta["source_files"])
    assert sorted(os.listdir(tmp_path / "remote")) == sorted(os.listdir(tmp_path / "local"))
    assert not [n for n in os.listdir(tmp_path / "remote") if "tmp" in n]
    assert_same_rows(str(tmp_path / "local"), str(tmp_path / "remote"))
