"""The Ray batch job's output folder (decode.jobs.ray_job describes the job).

`PartFolder` is OUT: a local folder or one on any pyarrow filesystem, holding one part file per
finished block (part-P.jsonl, or part-P.parquet when OUT ends in `.parquet`), each written whole
or not at all.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os

from decode.config import DecodeConfigError

PART = "part-"
FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}


def parquet_schema(id_type: str):
    """The columns of a Parquet part: the single-process job's record fields."""
    import pyarrow as pa
    return pa.schema([("id", pa.int64() if id_type == "int" else pa.string()), ("text", pa.string()),
                      ("token_ids", pa.list_(pa.int64())), ("finish_reason", pa.string()),
                      ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                      ("cached_tokens", pa.int64()), ("steps", pa.int64()), ("token_slots", pa.int64()),
                      ("error", pa.string()), ("content", pa.string()),
                      ("tool_calls", pa.list_(pa.struct([
                          ("id", pa.string()), ("type", pa.string()),
                          ("function", pa.struct([("name", pa.string()),
                                                  ("arguments", pa.string())]))])))])


@dataclasses.dataclass
class PartFolder:
    url: str          # as given
    fs: object        # pyarrow FileSystem
    root: str         # the folder's path on fs
    local: bool
    fmt: str          # 'jsonl' | 'parquet'

    @classmethod
    def at(cls, url: str) -> "PartFolder":
        import pyarrow.fs as pafs
        if "://" in url:
            fs, root = pafs.FileSystem.from_uri(url)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(url)
        fmt = "parquet" if url.rstrip("/").endswith(".parquet") else "jsonl"
        return cls(url, fs, root.rstrip("/") or "/", isinstance(fs, pafs.LocalFileSystem), fmt)

    @classmethod
    def open(cls, url: str) -> "PartFolder":
        """The folder, created if absent; refused (one DecodeConfigError) if it is a file or
        cannot be written."""
        import pyarrow.fs as pafs
        try:
            out = cls.at(url)
            if out.fs.get_file_info(out.root).type == pafs.FileType.File:
                raise DecodeConfigError(f"--output {url} is a file; with --ray it is a folder "
                                        "of part files (part-P.jsonl or .parquet)")
            out.fs.create_dir(out.root, recursive=True)
            probe = f"{out.root}/.write-check-{os.getpid()}"
            with out.fs.open_output_stream(probe) as f:
                f.write(b"")
            out.fs.delete_file(probe)
        except (OSError, ValueError) as e:   # pyarrow's errors are OSErrors; a bad URI a ValueError
            raise DecodeConfigError(f"--output {url} is not writable ({str(e).splitlines()[0]})") from None
        return out

    def parts(self) -> list[str]:
        import pyarrow.fs as pafs
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File
                      and i.base_name.startswith(PART) and os.path.splitext(i.base_name)[1] in FORMATS)

    def done_ids(self) -> set:
        """The id keys in the finished parts (each part is whole: written beside and renamed)."""
        from decode.jobs.lines import id_key
        done = set()
        for path in self.parts():
            try:
                ids = self.read_ids(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise DecodeConfigError(f"--output {path} is not a part of this tool ({e}); "
                                        "move it away") from None
            dup = done & set(map(id_key, ids))
            if dup:
                raise DecodeConfigError(f"--output {path}: id {sorted(dup)[0]} is in another part too")
            done |= set(map(id_key, ids))
        return done

    def read_ids(self, path: str) -> list:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq
            with self.fs.open_input_file(path) as f:
                return pq.read_table(f, columns=["id"]).column("id").to_pylist()
        with self.fs.open_input_stream(path) as f:
            data = f.read()
        return [json.loads(line)["id"] for line in data.split(b"\n") if line.strip()]

    def check_ids(self, where_ids: list) -> None:
        """A Parquet column holds one type: every id an int, or every one a string."""
        if self.fmt != "parquet" or not where_ids:
            return
        first = type(where_ids[0][1])
        for where, rid in where_ids:
            if type(rid) is not first:
                raise DecodeConfigError(f"{where}: field 'id' {rid!r} is a {type(rid).__name__} but "
                                        f"{where_ids[0][0]}'s is a {first.__name__}; a Parquet "
                                        "--output holds ids of one type")

    def write(self, name: str, records: list) -> str:
        """Write one block's records as part `name`, whole or not at all; returns its path."""
        path = f"{self.root}/{name}.{self.fmt}"
        data = self.encode(records)
        if not self.local:               # an object store publishes an object whole at close
            with self.fs.open_output_stream(path) as f:
                f.write(data)
            return path
        tmp = f"{self.root}/.{name}.{self.fmt}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def encode(self, records: list) -> bytes:
        if self.fmt == "jsonl":
            return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
        import pyarrow as pa
        import pyarrow.parquet as pq
        id_type = "int" if records and isinstance(records[0]["id"], int) else "str"
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(records, schema=parquet_schema(id_type)), buf)
        return buf.getvalue()
