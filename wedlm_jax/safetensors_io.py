"""The safetensors format, one tensor at a time, with no pickle anywhere.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(`name -> {dtype, shape, data_offsets}` plus an optional `__metadata__`), then the raw
little-endian tensor bytes. Reading the header alone gives every name, shape and dtype, so a
converter can check a whole checkpoint before touching any data; `read_tensor` then reads exactly
one tensor's bytes. bfloat16 is read and written through `ml_dtypes.bfloat16` (numpy has no
bfloat16 of its own, which is why `safe_open(..., framework='numpy')` cannot).

A checkpoint folder holds one `model.safetensors`, or shards listed by
`model.safetensors.index.json`, or (without an index) any set of `*.safetensors` files. A folder
with only PyTorch pickles (`pytorch_model.bin`, `*.pt`, `*.pth`) is refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct
from typing import Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.bin")

# safetensors dtype name <-> numpy dtype (little-endian). Only floating types are parameters.
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(ml_dtypes.bfloat16)}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2 ** 20


class CheckpointError(ValueError):
    """A checkpoint folder or file this project cannot read or write as asked."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: `file`, absolute byte offset `start`, `nbytes`."""
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def dtype_name(dtype) -> str:
    """The safetensors name of a numpy/jax floating dtype ('F32', 'BF16', ...)."""
    dt = np.dtype(dtype)
    if dt not in _NAMES:
        raise CheckpointError(f"dtype {np.dtype(dtype)} cannot be stored; supported: "
                              f"float64, float32, float16, bfloat16")
    return _NAMES[dt]


def read_header(file: str) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, from its header only (no tensor data is read)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{file}: not a safetensors file (header length {n} does not fit "
                                  f"in a file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: safetensors header is not a JSON object")
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), \
                entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry {entry!r}") \
                from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype}; supported: "
                                  f"{', '.join(DTYPES)}")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise CheckpointError(f"{file}: tensor {name!r} ({dtype} {list(shape)}) has data_offsets "
                                  f"[{begin}, {end}] inconsistent with its shape or the file size "
                                  f"({size} bytes)")
        out[name] = TensorInfo(name, file, dtype, shape, base + begin, nbytes)
    return out


def find_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint folder (see the module docstring)."""
    index = os.path.join(folder, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = sorted(set(weight_map.values()))
        missing = [x for x in files if not os.path.isfile(os.path.join(folder, x))]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return [os.path.join(folder, x) for x in files]
    if os.path.isfile(os.path.join(folder, SINGLE_NAME)):
        return [os.path.join(folder, SINGLE_NAME)]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return files
    pickles = sorted({os.path.basename(p) for pat in PICKLE_PATTERNS
                      for p in glob.glob(os.path.join(folder, pat))})
    if pickles:
        raise CheckpointError(f"{folder}: holds only PyTorch pickle files ({', '.join(pickles)}); "
                              f"they are never unpickled here (unsafe). Convert them to safetensors "
                              f"first, e.g. with transformers: model.save_pretrained(dir, "
                              f"safe_serialization=True)")
    raise CheckpointError(f"{folder}: no safetensors files (model.safetensors, "
                          f"{INDEX_NAME} or *.safetensors)")


def index_tensors(folder: str) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint folder by name, from headers only; checks that an index's
    weight_map agrees with the files and that no name appears in two files."""
    files = find_files(folder)
    out: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in out:
                raise CheckpointError(f"tensor {name!r} appears in both {out[name].file} and {file}")
            out[name] = info
    index = os.path.join(folder, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for name, shard in weight_map.items():
            info = out.get(name)
            if info is None or os.path.basename(info.file) != shard:
                where = "no file" if info is None else os.path.basename(info.file)
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to {shard} but found in "
                                      f"{where}")
    return out


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor's data as a fresh numpy array (reads exactly `info.nbytes` bytes)."""
    buf = bytearray(info.nbytes)
    with open(info.file, "rb") as f:
        f.seek(info.start)
        got = f.readinto(buf)
    if got != info.nbytes:
        raise CheckpointError(f"{info.file}: tensor {info.name!r} is truncated ({got} of "
                              f"{info.nbytes} bytes)")
    return np.frombuffer(buf, DTYPES[info.dtype]).reshape(info.shape)


def plan_shards(sizes: Sequence[int], max_shard_size: int) -> list[list[int]]:
    """Group tensor indices, in order, into shards of at most `max_shard_size` bytes each (a
    tensor larger than the limit gets a shard of its own)."""
    shards: list[list[int]] = []
    current, used = [], 0
    for i, n in enumerate(sizes):
        if current and used + n > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        shards.append(current)
    return shards


# The order the `safetensors` library writes a file's tensors in (header and data alike): by dtype,
# the larger of its Dtype enum first, then by name; a file written here is laid out as it would be.
_DTYPE_RANK = {"F16": 7, "BF16": 8, "F32": 11, "F64": 12}


def header_order(spec: tuple) -> tuple:
    """The sort key of a (name, dtype name, shape) spec: `_DTYPE_RANK`'s order, then the name."""
    return (-_DTYPE_RANK.get(spec[1], 0), spec[0])


def write_file(file: str, specs: Iterable[tuple[str, str, tuple[int, ...]]],
               fetch: Callable[[str], np.ndarray], on_tensor: Callable[[int], None] | None = None,
               chunk_bytes: int = 16 * 2 ** 20) -> None:
    """Write a safetensors file whose header is built from `specs` ((name, dtype name, shape)),
    laid out in `header_order` (the safetensors library's); each tensor's data comes from `fetch(name)`, one at a time, so only one is ever in memory.
    `fetch` may return any float array of the right shape (e.g. a transposed view): it is cast
    and made contiguous `chunk_bytes` at a time, so no second full-size copy is made."""
    specs = sorted(specs, key=header_order)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape in specs:
            arr = fetch(name)
            if tuple(arr.shape) != tuple(shape) or arr.dtype not in _NAMES:
                raise CheckpointError(f"{file}: tensor {name!r} came as {arr.dtype} "
                                      f"{list(arr.shape)}, its header says {dtype} {list(shape)}")
            rows = arr.reshape(1, -1) if arr.ndim < 2 else arr
            step = max(1, chunk_bytes // max(1, rows[0].size * DTYPES[dtype].itemsize))
            for i in range(0, rows.shape[0], step):
                chunk = np.ascontiguousarray(rows[i:i + step], dtype=DTYPES[dtype])
                f.write(chunk.reshape(-1).view(np.uint8).data)
            if on_tensor is not None:
                on_tensor(math.prod(shape) * DTYPES[dtype].itemsize)
            del arr, rows
