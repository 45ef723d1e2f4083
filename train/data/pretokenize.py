"""`python -m train.data.pretokenize --tokenizer DIR --out DIR --seq-len L FILES...`: JSONL and Parquet ->
ArrayRecord shards of packed rows plus a meta.json, the folder `data.packed_dir` reads.

FILES are files, folders or globs, local or on any filesystem pyarrow opens (gs://, s3://):
`.jsonl`, `.jsonl.gz`, `.jsonl.zst` and `.parquet` (train/data/sources.py). Records go through the same
parsing, validation and tokenization as the in-memory path (`train.data.pipeline.iter_records`: the formats
`text`, `prompt`/`response`, `messages` with optional `tools`; `file:line` or `file:row N` errors;
bad records skipped and counted with --skip-bad-lines) and the same greedy packer
(`train.data.pipeline.pack_rows`) into rows of L tokens with segment ids and maskable flags.

The plan: the inputs are cut into pieces (a JSONL file, a Parquet row group) and the pieces, in
input order, into units of at least --unit-bytes input bytes. Each unit is packed on its own (its
documents in input order, no row straddles two units) into shards of --shard-rows rows named
`shard_<unit>_<k>`; meta.json lists the shards in unit order. The plan depends on the inputs,
their sizes and --unit-bytes only, so the rows, and their order, are the same whether one
process packs the units (the default), --workers N local processes, or --ray [ADDRESS|local]
tasks on a Ray cluster.

The folder is built in place: plan.json first, then each shard under a temporary name renamed
when written, then a `unit_<unit>.json` marker once all of a unit's shards are there, and
meta.json last. A folder without meta.json is never read as data; rerunning the same command
keeps the finished units and packs the rest. An existing complete folder is refused unless
--force (which starts over); so is an unfinished run of other inputs or settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

from train.data import arrayrecord, sources
from train.data import pipeline as data_lib
from train.data.packed import PLAN_FILE

DEFAULT_SHARD_ROWS = 16384
DEFAULT_UNIT_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Job:
    """What every unit's packing needs (sent to each worker process or Ray task)."""
    tokenizer: str
    out: str
    seq_len: int
    shard_rows: int
    skip_bad_lines: bool = False
    append_eos: bool = True
    text_column: str | None = None
    messages_column: str | None = None


def make_units(pieces: list, unit_bytes: int) -> list[list]:
    """Consecutive pieces grouped until a group holds at least `unit_bytes` input bytes."""
    units, cur, size = [], [], 0
    for p in pieces:
        cur.append(p)
        size += p.size
        if size >= unit_bytes:
            units.append(cur)
            cur, size = [], 0
    if cur:
        units.append(cur)
    return units


@functools.lru_cache(maxsize=4)
def tokenizer_of(folder: str):
    return data_lib.load_tokenizer(folder)


def marker_name(k: int) -> str:
    return f"unit_{k:05d}.json"


def write_text(path: str, text: str) -> None:
    """A small file written under a temporary name and renamed (local path or URI)."""
    fs, p = sources.filesystem(path)
    tmp = f"{p}.tmp-{os.getpid()}"
    with fs.open_output_stream(tmp) as f:
        f.write(text.encode())
    fs.move(tmp, p)


def read_text(path: str) -> str | None:
    from pyarrow import fs as pafs
    fs, p = sources.filesystem(path)
    if fs.get_file_info(p).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(p) as f:
        return f.read().decode()


def pack_unit(job: Job, k: int, pieces: list) -> dict:
    """Pack unit `k` (its pieces in order) into shards `shard_<k>_<j>` of `job.out`, then write its
    marker; returns the marker's record {shards, lines, skipped, skipped_first, max_token_id}."""
    info = tokenizer_of(job.tokenizer)
    skipped, counts = [], {}

    def items():
        for piece in pieces:
            yield from sources.read_piece(piece, job.text_column, job.messages_column)

    docs = data_lib.iter_records(items(), info, vocab_size=info.vocab_size,
                                 skip_bad_lines=job.skip_bad_lines, append_eos=job.append_eos,
                                 skipped=skipped, counts=counts)
    shards, buf, tokens, max_id = [], [], 0, -1

    def flush():
        nonlocal buf, tokens
        name = f"shard_{k:05d}_{len(shards):04d}"
        arrayrecord.write_shard(job.out, name, buf)
        shards.append({"name": name, "rows": len(buf), "tokens": tokens})
        buf, tokens = [], 0

    for t, s, m in data_lib.pack_rows(docs, job.seq_len):
        buf.append(arrayrecord.encode_row(t, s, m))
        used = int((s > 0).sum())
        tokens += used
        max_id = max(max_id, int(t[:used].max()) if used else -1)
        if len(buf) == job.shard_rows:
            flush()
    if buf:
        flush()
    record = {"unit": k, "shards": shards, "lines": counts.get("lines", 0),
              "skipped": len(skipped), "skipped_first": skipped[:20], "max_token_id": max_id}
    write_text(sources.join(job.out, marker_name(k)), json.dumps(record))
    return record


def pack_unit_args(args) -> dict:
    return pack_unit(*args)


def run_units(job: Job, units: list, todo: list[int], workers: int, ray: str | None) -> dict:
    """{unit: record} of the units in `todo`, packed by this process, `workers` local processes
    or Ray tasks (train/data/ray_pack.py)."""
    jobs = [(job, k, units[k]) for k in todo]
    if ray is not None:
        from train.data import ray_pack
        return ray_pack.run(jobs, ray, workers)
    if workers > 1 and len(jobs) > 1:
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            return {r["unit"]: r for r in pool.imap_unordered(pack_unit_args, jobs)}
    return {k: pack_unit(*args) for args, k in zip(jobs, todo)}


SKIP_HINT = "(--skip-bad-lines skips such lines)"       # this door's flag for data.py's hint


def make_plan(inputs, job: Job, unit_bytes: int) -> tuple[dict, list]:
    """(plan.json's contents, the units) of the inputs: everything the rows depend on."""
    try:
        files = sources.list_inputs([str(f) for f in inputs])
        units = make_units(sources.plan_pieces(files), unit_bytes)
    except sources.InputError as e:
        raise data_lib.DataError(str(e)) from None
    plan = {"format": arrayrecord.FORMAT, "seq_len": job.seq_len, "shard_rows": job.shard_rows,
            "unit_bytes": unit_bytes, "append_eos": job.append_eos,
            "text_column": job.text_column, "messages_column": job.messages_column,
            "tokenizer_sha256": data_lib.tokenizer_sha256(job.tokenizer),
            "source_files": [{"path": p, "size": s} for p, s in files],
            "units": [[dataclasses.asdict(p) for p in u] for u in units]}
    return plan, units


def prepare_out(out: str, plan: dict, force: bool) -> bool:
    """Make `out` ready for `plan`: absent or empty (created), an unfinished run of the same plan
    (kept: its finished units are reused), or, with force, a complete packed folder or an
    unfinished run of another plan (emptied). True when the folder was created here."""
    from pyarrow import fs as pafs
    fs, p = sources.filesystem(out)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.NotFound:
        fs.create_dir(p, recursive=True)
        return True
    if info.type != pafs.FileType.Directory:
        raise data_lib.DataError(f"{out}: exists and is a file, not a folder; refusing to replace it")
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(p))}
    if not names:
        return False
    if data_lib.PACKED_META not in names and PLAN_FILE not in names:
        raise data_lib.DataError(f"{out}: exists, is not empty and holds no packed data folder; "
                                 f"refusing to replace it (even with --force); choose another "
                                 f"output folder")
    if data_lib.PACKED_META in names and not force:
        raise data_lib.DataError(f"{out}: already holds a packed data folder; pass --force to "
                                 f"replace it")
    old = read_text(sources.join(out, PLAN_FILE)) if data_lib.PACKED_META not in names else None
    if old is not None and json.loads(old) == plan:
        return False
    if not force:
        was = json.loads(old) if old else {}
        diff = sorted(k for k in set(plan) | set(was) if plan.get(k) != was.get(k))
        raise data_lib.DataError(f"{out}: holds an unfinished run of other inputs or settings "
                                 f"(different {', '.join(diff)}); pass --force to start over")
    fs.delete_dir_contents(p)
    return False


def finished_units(out: str, n: int) -> dict:
    """{unit: record} of the units whose marker is in `out`."""
    from pyarrow import fs as pafs
    fs, p = sources.filesystem(out)
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(p))}
    done = {}
    for k in range(n):
        if marker_name(k) in names:
            rec = json.loads(read_text(sources.join(out, marker_name(k))))
            if all(s["name"] + arrayrecord.SUFFIX in names for s in rec["shards"]):
                done[k] = rec
    return done


def pretokenize(inputs, tokenizer: str, out: str, seq_len: int, *,
                shard_rows: int = DEFAULT_SHARD_ROWS, unit_bytes: int = DEFAULT_UNIT_BYTES,
                skip_bad_lines: bool = False, append_eos: bool = True, force: bool = False,
                workers: int = 1, ray: str | None = None, text_column: str | None = None,
                messages_column: str | None = None, log=None) -> dict:
    """Write (or finish) the packed folder `out`; returns its meta.json contents."""
    if seq_len < 2:
        raise data_lib.DataError(f"--seq-len must be >= 2, got {seq_len}")
    if shard_rows < 1 or workers < 1 or unit_bytes < 1:
        raise data_lib.DataError(f"--shard-rows, --unit-bytes and --workers must be >= 1, got "
                                 f"{shard_rows}, {unit_bytes} and {workers}")
    if text_column and messages_column:
        raise data_lib.DataError("--text-column and --messages-column are exclusive")
    if not inputs:
        raise data_lib.DataError("no input files")
    out = out if "://" in out else os.path.abspath(out)
    info = tokenizer_of(os.path.abspath(tokenizer))
    job = Job(info.folder, out, seq_len, shard_rows, skip_bad_lines, append_eos, text_column,
              messages_column)
    plan, units = make_plan(inputs, job, unit_bytes)
    created = prepare_out(out, plan, force)
    write_text(sources.join(out, PLAN_FILE), json.dumps(plan, indent=1))
    done = finished_units(out, len(units))
    if log and done:
        log(f"pretokenize: {len(done)} of {len(units)} unit(s) already packed, kept")
    try:
        done.update(run_units(job, units, [k for k in range(len(units)) if k not in done],
                              workers, ray))
    except (data_lib.DataError, sources.InputError) as e:
        if created and not finished_units(out, len(units)):
            fs, p = sources.filesystem(out)
            fs.delete_dir(p)             # nothing finished: leave nothing behind
        raise data_lib.DataError(str(e).replace(data_lib.SKIP_HINT, SKIP_HINT)) from None
    meta = make_meta(plan, [done[k] for k in range(len(units))], info, workers, ray)
    write_text(sources.join(out, data_lib.PACKED_META), json.dumps(meta, indent=1))
    return meta


def make_meta(plan: dict, records: list[dict], info, workers: int, ray: str | None) -> dict:
    shards = [s for r in records for s in r["shards"]]
    skipped_first = [x for r in records for x in r["skipped_first"]][:20]
    if not shards:
        n = sum(r["skipped"] for r in records)
        raise data_lib.DataError(
            f"no usable record in {', '.join(f['path'] for f in plan['source_files'])}"
            + (f" ({n} skipped)" if n else ""))
    return {
        "format": arrayrecord.FORMAT, "seq_len": plan["seq_len"],
        "rows_per_shard": plan["shard_rows"], "total_rows": sum(s["rows"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards), "shards": shards,
        "record": "int32 tokens[L] | int32 segment_ids[L] | uint8 maskable[L], little-endian",
        "tokenizer": {"folder": info.folder, "sha256": plan["tokenizer_sha256"],
                      "vocab_size": info.vocab_size,
                      "mask_token_id": data_lib.find_mask_token(info),
                      "eos_token_id": info.eos_token_id},
        "max_token_id": max(r["max_token_id"] for r in records),
        "append_eos": plan["append_eos"],
        "document_order": ("input order within each unit of the plan, whatever the number of "
                           "workers (rows are shuffled by the training pipeline)"),
        "packed_by": f"ray {ray}" if ray is not None else f"{workers} local worker(s)",
        "unit_bytes": plan["unit_bytes"], "units": len(records),
        "source_files": plan["source_files"],
        "lines": sum(r["lines"] for r in records),
        "skipped_lines": sum(r["skipped"] for r in records), "skipped_first": skipped_first,
    }


def parse_bytes(text: str) -> int:
    """`268435456`, `256M`, `1G`, `64k` -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 256M)") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.data.pretokenize",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="JSONL(.gz/.zst) or Parquet files, folders or globs "
                                            "(local, gs://, s3://)")
    p.add_argument("--tokenizer", required=True, help="folder with tokenizer.json")
    p.add_argument("--out", required=True, help="output folder (data.packed_dir; local or gs://)")
    p.add_argument("--seq-len", type=int, required=True, help="packed row length (data.seq_len)")
    p.add_argument("--shard-rows", type=int, default=DEFAULT_SHARD_ROWS, help="rows per shard")
    p.add_argument("--unit-bytes", type=parse_bytes, default=DEFAULT_UNIT_BYTES,
                   help="input bytes packed as one unit of work (default 256M; rows never straddle "
                        "units; part of the plan, so it changes the rows)")
    p.add_argument("--text-column", help="Parquet: the column holding pretraining text")
    p.add_argument("--messages-column", help="Parquet: the column holding chat messages "
                                             "(a `tools` column is used when present)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed records instead of stopping")
    p.add_argument("--no-append-eos", action="store_true",
                   help="do not end pretraining documents with EOS (data.append_eos=false)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--workers", type=int, default=1,
                   help="local processes packing units at once; with --ray, the most tasks at "
                        "once (and, for `local`, the CPUs of the cluster it starts)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS|local",
                   help="pack the units as tasks on a Ray cluster (`local` starts one here)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    try:
        meta = pretokenize(a.files, a.tokenizer, a.out, a.seq_len, shard_rows=a.shard_rows,
                           unit_bytes=a.unit_bytes, skip_bad_lines=a.skip_bad_lines,
                           append_eos=not a.no_append_eos, force=a.force, workers=a.workers,
                           ray=a.ray, text_column=a.text_column,
                           messages_column=a.messages_column, log=log)
    except data_lib.DataError as e:
        print(f"pretokenize: error: {e}", file=sys.stderr)
        return 2
    if meta["skipped_lines"]:
        log(f"pretokenize: skipped {meta['skipped_lines']} malformed record(s); first: "
            f"{meta['skipped_first'][0]}")
    print(f"pretokenize: {meta['lines'] - meta['skipped_lines']} documents -> {meta['total_rows']} "
          f"rows of {meta['seq_len']} ({meta['tokens']} tokens) in {len(meta['shards'])} shard(s) "
          f"at {a.out if '://' in a.out else os.path.abspath(a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
