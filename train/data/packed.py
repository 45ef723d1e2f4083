"""`data.packed_dir`: the checks and readers of pretokenized data, behind one interface.

`data.packed_dir` names one of:
  - an ArrayRecord folder written by `python -m train.data.pretokenize` (train/data/arrayrecord.py), local
    or on any filesystem pyarrow and ArrayRecord open (gs://);
  - a folder of the earlier .npy layout (`wedlm-packed-v1`: `<shard>.tokens.npy`,
    `.segment_ids.npy`, `.maskable.npy` per shard), still read memory-mapped so folders packed
    before keep training; nothing writes it any more;
  - a mixture file (.yaml/.yml/.json) listing packed folders with weights (train/data/mixture.py).

`read_packed_meta` checks the meta.json and every shard before anything compiles (an unfinished
pretokenize run, a missing or unreadable shard, a seq_len other than the config's: one DataError
naming the file); `check_packed_tokenizer` compares the rows' tokenizer with the run's;
`open_packed` returns the rows for `train.data.pipeline.make_pipeline`, whose row shuffle, global index
mapping, per-process rows and resume state are the same for every kind.
"""

from __future__ import annotations

import json
import os

import numpy as np

from train.data import arrayrecord
from train.data.pipeline import PACKED_ARRAYS, PACKED_META, DataError, tokenizer_sha256

NPY_FORMAT = "wedlm-packed-v1"
MIXTURE_SUFFIXES = (".yaml", ".yml", ".json")
PLAN_FILE = "plan.json"


def is_mixture(path: str) -> bool:
    return path.lower().endswith(MIXTURE_SUFFIXES) and "://" not in path and os.path.isfile(path)


def npy_shard_path(folder: str, name: str, key: str) -> str:
    return os.path.join(folder, f"{name}.{key}.npy")


def load_meta(folder: str) -> dict:
    """meta.json of `folder` (local or a URI) with its required keys; DataError naming it."""
    from train.data.sources import InputError, filesystem, join
    path = join(folder, PACKED_META)
    try:
        fs, p = filesystem(folder)
        from pyarrow import fs as pafs
        kind = fs.get_file_info(p).type
        if kind != pafs.FileType.Directory:
            raise DataError(f"data.packed_dir: {folder} is not a folder")
        if fs.get_file_info(p + "/" + PACKED_META).type != pafs.FileType.File:
            unfinished = fs.get_file_info(p + "/" + PLAN_FILE).type == pafs.FileType.File
            raise DataError(f"{path}: missing " + (
                "(an unfinished `python -m train.data.pretokenize` run: rerun the same command to "
                "finish it)" if unfinished else
                "(data.packed_dir must be a folder written by `python -m train.data.pretokenize`)"))
        with fs.open_input_stream(p + "/" + PACKED_META) as f:
            meta = json.loads(f.read())
    except InputError as e:
        raise DataError(str(e)) from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    need = ("format", "seq_len", "rows_per_shard", "total_rows", "shards", "tokenizer",
            "max_token_id")
    missing = [k for k in need if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise DataError(f"{path}: missing key(s) {', '.join(missing)}")
    if meta["format"] not in (arrayrecord.FORMAT, NPY_FORMAT):
        raise DataError(f"{path}: format {meta['format']!r}, expected {arrayrecord.FORMAT!r} "
                        f"(or the older {NPY_FORMAT!r})")
    return meta


def read_packed_meta(folder: str, *, seq_len: int | None = None) -> dict:
    """The checked meta of a packed folder or a mixture file (see the module docstring)."""
    if is_mixture(folder):
        from train.data import mixture
        return mixture.read_mixture_meta(folder, seq_len=seq_len)
    from train.data.sources import join
    meta = load_meta(folder)
    path = join(folder, PACKED_META)
    L = int(meta["seq_len"])
    if seq_len is not None and L != seq_len:
        raise DataError(f"{path}: rows were packed to seq_len {L}, but data.seq_len is {seq_len} "
                        f"(pretokenize again with --seq-len {seq_len}, or set data.seq_len={L})")
    if meta["format"] == NPY_FORMAT:
        check_npy_shards(folder, meta, path)
    else:
        try:
            arrayrecord.check_shards(folder, meta, path)
        except arrayrecord.ShardError as e:
            raise DataError(str(e)) from None
    total = sum(int(s["rows"]) for s in meta["shards"])
    if total != int(meta["total_rows"]) or total == 0:
        raise DataError(f"{path}: the shards hold {total} rows, total_rows says "
                        f"{meta['total_rows']}" if total else f"{path}: no rows")
    return meta


def check_npy_shards(folder: str, meta: dict, path: str) -> None:
    """The .npy files of every shard: present, dtype and shape from their headers (no data)."""
    L = int(meta["seq_len"])
    for shard in meta["shards"]:
        rows = int(shard["rows"])
        for key, dtype in PACKED_ARRAYS.items():
            f = npy_shard_path(folder, shard["name"], key)
            if not os.path.isfile(f):
                raise DataError(f"{f}: missing (listed in {path})")
            try:
                with open(f, "rb") as fh:
                    version = np.lib.format.read_magic(fh)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dt = read(fh)
            except (OSError, ValueError) as e:
                raise DataError(f"{f}: not a .npy file ({e})") from None
            if tuple(shape) != (rows, L) or np.dtype(dt) != np.dtype(dtype):
                raise DataError(f"{f}: holds {np.dtype(dt).name} {tuple(shape)}, {path} states "
                                f"{np.dtype(dtype).name} {(rows, L)}")


def check_packed_tokenizer(meta: dict, folder: str, info, vocab_size: int) -> None:
    """The packed rows (of every folder of a mixture) were tokenized with this tokenizer, and
    fit the model's vocabulary; DataError naming the folder's meta.json otherwise."""
    if "mixture" in meta:
        for part in meta["mixture"]:
            check_packed_tokenizer(part["meta"], part["dir"], info, vocab_size)
        return
    from train.data.sources import join
    path = join(folder, PACKED_META)
    want = meta["tokenizer"].get("sha256")
    have = tokenizer_sha256(info.folder)
    if want != have:
        raise DataError(f"{path}: the rows were tokenized with a different tokenizer.json "
                        f"(sha256 {str(want)[:12]}..., from {meta['tokenizer'].get('folder')}) than "
                        f"{info.folder}/tokenizer.json (sha256 {have[:12]}...)")
    if int(meta["max_token_id"]) >= vocab_size:
        raise DataError(f"{path}: token id {meta['max_token_id']} is outside the model vocabulary "
                        f"[0, {vocab_size})")


def open_packed(folder: str, meta: dict | None = None):
    """The rows of a packed folder or mixture for `train.data.pipeline.make_pipeline`."""
    meta = read_packed_meta(folder) if meta is None else meta
    if "mixture" in meta:
        from train.data import mixture
        return mixture.MixtureRows(meta)
    if meta["format"] == NPY_FORMAT:
        return {k: NpyRows(folder, k, meta) for k in PACKED_ARRAYS}
    return arrayrecord.ArrayRecordRows(folder, meta)


class NpyRows:
    """One array of an .npy packed folder as a read-only sequence of rows: `len()`, and `[i]`
    reads row i from its shard's memory map (at most `cache` shards mapped at once)."""

    def __init__(self, folder: str, key: str, meta: dict, cache: int = 32):
        self.folder, self.key = folder, key
        self.names = [s["name"] for s in meta["shards"]]
        self.starts = np.cumsum([0] + [int(s["rows"]) for s in meta["shards"]])
        self.cache = cache
        self.maps: dict = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard_map(self, k: int):
        m = self.maps.pop(k, None)
        if m is None:
            m = np.load(npy_shard_path(self.folder, self.names[k], self.key), mmap_mode="r")
            if len(self.maps) >= self.cache:
                self.maps.pop(next(iter(self.maps)))
        self.maps[k] = m  # most recently used last
        return m

    def __getitem__(self, i):
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return np.array(self.shard_map(k)[i - self.starts[k]])
