"""The packed-row format written by `python -m train.data.pretokenize` and read by `data.packed_dir`:
ArrayRecord shards (the `array-record` package, group size 1 for random access) plus a meta.json.

One record is one packed row of L tokens, raw little-endian: int32 tokens[L], int32
segment_ids[L], uint8 maskable[L] (9 L bytes). meta.json (format `wedlm-packed-arrayrecord-v1`)
holds seq_len, rows_per_shard, total_rows and tokens, the shards [{name, rows, tokens}] in reading
order, the tokenizer (folder, sha256 of tokenizer.json, vocab size, mask and eos ids),
max_token_id, append_eos, the source files with their sizes, the plan (unit_bytes, units), the
line counts and the skipped lines.

`write_shard` writes a shard under a temporary name beside its final one and renames it (for a
gs:// or s3:// folder: written locally, uploaded to a temporary name, moved). `check_shards`
opens every shard's index (no row is read) before training starts. `ArrayRecordRows` serves a
folder's rows to the training pipeline through Grain's `ArrayRecordDataSource` (every shard
addressed as `path[0:rows]`, so no file is opened until a row of it is read).
"""

from __future__ import annotations

import os
import tempfile
import threading

import numpy as np

FORMAT = "wedlm-packed-arrayrecord-v1"
SUFFIX = ".array_record"
WRITER_OPTIONS = "group_size:1"


class ShardError(ValueError):
    """An unreadable or inconsistent shard (the message names the file)."""


def encode_row(tokens, segment_ids, maskable) -> bytes:
    return (np.asarray(tokens, "<i4").tobytes() + np.asarray(segment_ids, "<i4").tobytes()
            + np.asarray(maskable, np.uint8).tobytes())


def decode_row(record: bytes, seq_len: int) -> dict:
    """The row dict {tokens int32[L], segment_ids int32[L], maskable bool[L]} of one record."""
    if len(record) != 9 * seq_len:
        raise ShardError(f"a record of {len(record)} bytes, expected {9 * seq_len} "
                         f"(9 x seq_len {seq_len})")
    t = np.frombuffer(record, "<i4", seq_len, 0).astype(np.int32)
    s = np.frombuffer(record, "<i4", seq_len, 4 * seq_len).astype(np.int32)
    m = np.frombuffer(record, np.uint8, seq_len, 8 * seq_len).astype(bool)
    return {"tokens": t, "segment_ids": s, "maskable": m}


def shard_file(folder: str, name: str) -> str:
    from train.data.sources import join
    return join(folder, name + SUFFIX)


def write_shard(folder: str, name: str, records: list[bytes]) -> None:
    """Write `records` as the shard `name` of `folder` (temporary name, then renamed)."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from train.data.sources import filesystem
    final = shard_file(folder, name)
    tag = f".tmp-{os.getpid()}-{threading.get_ident()}"
    local = "://" not in folder
    if local:
        path = final + tag
    else:
        fd, path = tempfile.mkstemp(suffix=SUFFIX)
        os.close(fd)
    try:
        writer = ArrayRecordWriter(path, WRITER_OPTIONS)
        for r in records:
            writer.write(r)
        writer.close()
        if local:
            os.replace(path, final)
        else:
            fs, dst = filesystem(final)
            with open(path, "rb") as src, fs.open_output_stream(dst + tag) as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            fs.move(dst + tag, dst)
    finally:
        if os.path.exists(path):
            os.remove(path)


def check_shards(folder: str, meta: dict, meta_path: str) -> None:
    """Every shard named in meta.json opens and holds the rows it states, of 9 x seq_len bytes
    (its first record is read); ShardError naming the file otherwise."""
    from array_record.python.array_record_module import ArrayRecordReader
    L = int(meta["seq_len"])
    for shard in meta["shards"]:
        path = shard_file(folder, shard["name"])
        if "://" not in path and not os.path.isfile(path):
            raise ShardError(f"{path}: missing (listed in {meta_path})")
        try:
            reader = ArrayRecordReader(path)
            n = reader.num_records()
            first = reader.read([0])[0] if n else b""
            reader.close()
        except Exception as e:  # the reader raises RuntimeError/OSError/ValueError by cause
            raise ShardError(f"{path}: unreadable as ArrayRecord ({str(e).splitlines()[0]})") \
                from None
        if n != int(shard["rows"]):
            raise ShardError(f"{path}: holds {n} rows, {meta_path} states {shard['rows']}")
        if len(first) != 9 * L:
            raise ShardError(f"{path}: rows of {len(first)} bytes, {meta_path} states seq_len {L} "
                             f"({9 * L} bytes a row)")


class ArrayRecordRows(dict):
    """A packed ArrayRecord folder as the `rows` of `train.data.pipeline.make_pipeline`: keys tokens,
    segment_ids, maskable, each a sequence (`len`, `[i]`) over the same records; the three reads
    of one row decode its record once."""

    def __init__(self, folder: str, meta: dict):
        import grain
        self.seq_len = int(meta["seq_len"])
        paths = [f"{shard_file(folder, s['name'])}[0:{int(s['rows'])}]" for s in meta["shards"]]
        self.source = grain.sources.ArrayRecordDataSource(paths)
        self.last: tuple[int, dict] = (-1, {})
        super().__init__({k: _Field(self, k) for k in ("tokens", "segment_ids", "maskable")})

    def row(self, i) -> dict:
        i = int(i)
        last = self.last
        if last[0] == i:
            return last[1]
        if not 0 <= i < len(self.source):
            raise IndexError(f"row {i} of {len(self.source)}")
        r = decode_row(self.source[i], self.seq_len)
        self.last = (i, r)
        return r


class _Field:
    def __init__(self, rows: ArrayRecordRows, key: str):
        self.rows, self.key = rows, key

    def __len__(self) -> int:
        return len(self.rows.source)

    def __getitem__(self, i):
        return self.rows.row(i)[self.key]
