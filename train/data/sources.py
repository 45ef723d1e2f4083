"""The inputs of `python -m train.data.pretokenize`: JSONL (plain, .gz, .zst) and Parquet files, given as
files, folders or globs on any filesystem pyarrow opens (local paths, gs://, s3://, hdfs://).

`list_inputs` expands the arguments into files with their sizes, in a fixed order (the arguments in
the order given; a folder's or a glob's files sorted by path). `plan_pieces` cuts them into
pieces, the smallest units of work: a whole JSONL file (a compressed stream cannot be entered in
the middle, and `file:line` needs every earlier line) or one Parquet row group. `read_piece`
yields a piece's records as (where, record): `file:line` and the raw line's bytes for JSONL,
`file:row` and a dict for Parquet (the whole row, or {"text": ...} / {"messages": ..., "tools":
...} when a column is named), which `train.data.pipeline.iter_records` parses and tokenizes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Iterator, Sequence

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst",
                  ".jsonl.zstd")
PARQUET_SUFFIXES = (".parquet", ".pq")
READ_CHUNK = 1 << 20


class InputError(ValueError):
    """An input that cannot be listed or opened (missing file, unknown format, bad Parquet)."""


def filesystem(path: str):
    """(pyarrow filesystem, the path inside it) of a local path or a URI (gs://, s3://, ...)."""
    from pyarrow import fs as pafs
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... by scheme
            raise InputError(f"{path}: cannot open its filesystem ({e})") from None
    return pafs.LocalFileSystem(), os.path.abspath(path)


def join(root: str, name: str) -> str:
    """`root`/`name` for a local path or a URI."""
    return root.rstrip("/") + "/" + name if "://" in root else os.path.join(root, name)


def _uri(original: str, fs_path: str) -> str:
    """A path inside the filesystem of `original` written the way `original` is (scheme kept)."""
    if "://" in original:
        return original.split("://", 1)[0] + "://" + fs_path
    return fs_path


def input_kind(path: str) -> str | None:
    low = path.lower()
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def list_inputs(specs: Sequence[str]) -> list[tuple[str, int]]:
    """[(path or URI, size in bytes)] of every input file the arguments name, in order; each
    argument is a file, a folder (its JSONL/Parquet files, recursively) or a glob (* ? [...])."""
    from pyarrow import fs as pafs
    out, seen = [], set()
    for spec in specs:
        fs, p = filesystem(spec)
        if any(c in spec for c in "*?["):
            base = p[:min(p.index(c) for c in "*?[" if c in p)].rsplit("/", 1)[0] or "/"
            try:
                infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            except (OSError, FileNotFoundError) as e:
                raise InputError(f"{spec}: cannot list {base} ({e})") from None
            found = sorted(i.path for i in infos if i.type == pafs.FileType.File
                           and fnmatch.fnmatchcase(i.path, p))
            sizes = {i.path: i.size for i in infos}
            if not found:
                raise InputError(f"{spec}: matches no file")
            files = [(f, sizes[f]) for f in found]
        else:
            info = fs.get_file_info(p)
            if info.type == pafs.FileType.NotFound:
                raise InputError(f"{spec}: does not exist")
            if info.type == pafs.FileType.Directory:
                infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
                files = sorted((i.path, i.size) for i in infos if i.type == pafs.FileType.File
                               and input_kind(i.path))
                if not files:
                    raise InputError(f"{spec}: a folder without .jsonl(.gz/.zst) or .parquet files")
            else:
                files = [(p, info.size)]
        for f, size in files:
            if input_kind(f) is None:
                raise InputError(f"{_uri(spec, f)}: not a .jsonl, .jsonl.gz, .jsonl.zst or "
                                 f".parquet file")
            if f not in seen:
                seen.add(f)
                out.append((_uri(spec, f), int(size)))
    return out


@dataclasses.dataclass(frozen=True)
class Piece:
    """The smallest unit of work: a JSONL file, or row group `row_group` of a Parquet file (its
    first row is row `first_row` of the file)."""
    path: str
    kind: str
    size: int
    row_group: int = -1
    first_row: int = 0


def plan_pieces(files: Sequence[tuple[str, int]]) -> list[Piece]:
    """The pieces of the listed files, in order (Parquet footers are read here, nothing else)."""
    pieces = []
    for path, size in files:
        if input_kind(path) == "jsonl":
            pieces.append(Piece(path, "jsonl", size))
            continue
        md = _parquet_file(path).metadata
        first = 0
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            nbytes = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
            pieces.append(Piece(path, "parquet", int(nbytes), g, first))
            first += rg.num_rows
    return pieces


def _parquet_file(path: str):
    import pyarrow.parquet as pq
    fs, p = filesystem(path)
    try:
        return pq.ParquetFile(fs.open_input_file(p))
    except Exception as e:  # ArrowInvalid (not Parquet), OSError
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None


def _lines(stream) -> Iterator[bytes]:
    rest = b""
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            break
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        yield from parts
    if rest:
        yield rest


def read_piece(piece: Piece, text_column: str | None = None,
               messages_column: str | None = None) -> Iterator[tuple[str, object]]:
    """(where, record) of every record of the piece, in order (see the module docstring)."""
    if piece.kind == "jsonl":
        fs, p = filesystem(piece.path)
        try:
            stream = fs.open_input_stream(p, compression="detect")
        except OSError as e:
            raise InputError(f"{piece.path}: cannot open ({e})") from None
        with stream:
            try:
                for lineno, raw in enumerate(_lines(stream), 1):
                    yield f"{piece.path}:{lineno}", raw
            except OSError as e:          # a truncated or corrupt .gz/.zst stream
                raise InputError(f"{piece.path}: unreadable ({e})") from None
        return
    table = _parquet_file(piece.path).read_row_group(piece.row_group, columns=_columns(
        piece.path, text_column, messages_column))
    for i, row in enumerate(table.to_pylist()):
        where = f"{piece.path}:row {piece.first_row + i + 1}"
        if text_column:
            yield where, {"text": row[text_column]}
        elif messages_column:
            rec = {"messages": row[messages_column]}
            if row.get("tools") is not None:
                rec["tools"] = row["tools"]
            yield where, rec
        else:
            yield where, {k: v for k, v in row.items() if v is not None}


def _columns(path: str, text_column: str | None, messages_column: str | None):
    if not (text_column or messages_column):
        return None
    names = _parquet_file(path).schema_arrow.names
    want = text_column or messages_column
    if want not in names:
        flag = "--text-column" if text_column else "--messages-column"
        raise InputError(f"{path}: no column {want!r} ({flag}); its columns: {', '.join(names)}")
    return [want] + (["tools"] if messages_column and "tools" in names else [])
