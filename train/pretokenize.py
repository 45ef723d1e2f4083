"""`python -m train.pretokenize --tokenizer DIR --out DIR --seq-len L FILES...`: JSONL -> a packed,
memory-mappable folder for `data.packed_dir` (the at-scale data path; train/data.py describes the
folder layout).

The files are streamed line by line through the same parsing, validation and tokenization as the
in-memory path (`train.data.iter_documents`: same formats, same `file:line: reason` errors, bad
lines skipped and counted with --skip-bad-lines) and packed with the same greedy packer
(`train.data.pack_rows`) into rows of L tokens with segment ids and maskable flags. Documents are
packed in file order: unlike the in-memory path there is no document shuffle at pack time (the
training pipeline shuffles rows with `data.shuffle_seed`; shuffle the JSONL lines beforehand if
documents of one source must not share neighbouring rows).

Rows are written in shards of --shard-rows rows (`<name>.tokens.npy`, `.segment_ids.npy`,
`.maskable.npy`), each written as soon as it is full, so memory holds one shard, not the corpus.
The folder is built under a temporary sibling and renamed into place when complete; an existing
output is refused unless --force.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from train import data as data_lib
from wedlm_jax.checkpoints.folders import atomic_output_dir, check_out_dir
from wedlm_jax.safetensors_io import CheckpointError

DEFAULT_SHARD_ROWS = 16384


class ShardWriter:
    """Collects rows and writes each full shard of `shard_rows` rows to `folder`; holds at most one
    shard's rows."""

    def __init__(self, folder: str, seq_len: int, shard_rows: int, prefix: str = "shard"):
        self.folder, self.seq_len, self.shard_rows = folder, seq_len, shard_rows
        self.prefix = prefix
        self.buf = {k: np.zeros((shard_rows, seq_len), dt) for k, dt in data_lib.PACKED_ARRAYS.items()}
        self.fill = 0
        self.shards: list[dict] = []
        self.max_token_id = -1

    def add(self, tokens, segment_ids, maskable) -> None:
        self.buf["tokens"][self.fill] = tokens
        self.buf["segment_ids"][self.fill] = segment_ids
        self.buf["maskable"][self.fill] = maskable
        self.fill += 1
        if self.fill == self.shard_rows:
            self.flush()

    def flush(self) -> None:
        if not self.fill:
            return
        name = f"{self.prefix}_{len(self.shards):05d}"
        for key, arr in self.buf.items():
            np.save(data_lib.shard_path(self.folder, name, key), arr[:self.fill])
        self.max_token_id = max(self.max_token_id, int(self.buf["tokens"][:self.fill].max()))
        self.shards.append({"name": name, "rows": self.fill})
        self.fill = 0


def pack_part(files, tokenizer: str, folder: str, seq_len: int, shard_rows: int,
              skip_bad_lines: bool, append_eos: bool, part: tuple[int, int]) -> dict:
    """One worker's share (`part` = (k, n): lines k mod n) packed into its own shards in
    `folder`; returns {'shards', 'skipped', 'lines', 'max_token_id'}."""
    info = data_lib.load_tokenizer(tokenizer)
    writer = ShardWriter(folder, seq_len, shard_rows,
                         prefix="shard" if part[1] == 1 else f"shard{part[0]:03d}")
    skipped, counts = [], {}
    docs = data_lib.iter_documents(files, info, vocab_size=info.vocab_size,
                                   skip_bad_lines=skip_bad_lines, append_eos=append_eos,
                                   skipped=skipped, counts=counts, part=part)
    for row in data_lib.pack_rows(docs, seq_len):
        writer.add(*row)
    writer.flush()
    return {"shards": writer.shards, "skipped": skipped, "lines": counts.get("lines", 0),
            "max_token_id": writer.max_token_id}


def pretokenize(files, tokenizer: str, out: str, seq_len: int, *,
                shard_rows: int = DEFAULT_SHARD_ROWS, skip_bad_lines: bool = False,
                append_eos: bool = True, force: bool = False, workers: int = 1) -> dict:
    """Write the packed folder `out` (`workers` processes, each packing every workers-th line);
    returns its meta.json contents."""
    if seq_len < 2:
        raise data_lib.DataError(f"--seq-len must be >= 2, got {seq_len}")
    if shard_rows < 1 or workers < 1:
        raise data_lib.DataError(f"--shard-rows and --workers must be >= 1, got {shard_rows} and "
                                 f"{workers}")
    if not files:
        raise data_lib.DataError("no input files")
    out = os.path.abspath(out)
    is_packed = lambda d: os.path.exists(os.path.join(d, data_lib.PACKED_META))
    try:
        check_out_dir(out, force, is_packed, "a packed data folder")
    except CheckpointError as e:
        raise data_lib.DataError(str(e)) from None
    files = [str(f) for f in files]
    data_lib.check_files(files)
    info = data_lib.load_tokenizer(tokenizer)
    vocab = info.vocab_size
    with atomic_output_dir(out, force, is_packed, "a packed data folder") as tmp:
        jobs = [(files, tokenizer, tmp, seq_len, shard_rows, skip_bad_lines, append_eos,
                 (w, workers)) for w in range(workers)]
        if workers > 1:
            import multiprocessing
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                parts = pool.starmap(pack_part, jobs)
        else:
            parts = [pack_part(*jobs[0])]
        shards = [sh for p in parts for sh in p["shards"]]
        skipped = [x for p in parts for x in p["skipped"]]
        if not shards:
            raise data_lib.DataError(f"no usable line in {', '.join(files)}"
                                     + (f" ({len(skipped)} skipped)" if skipped else ""))
        meta = {
            "format": data_lib.PACKED_FORMAT, "seq_len": seq_len, "rows_per_shard": shard_rows,
            "total_rows": sum(s["rows"] for s in shards), "shards": shards,
            "tokenizer": {"folder": os.path.abspath(tokenizer),
                          "sha256": data_lib.tokenizer_sha256(tokenizer), "vocab_size": vocab,
                          "mask_token_id": data_lib.find_mask_token(info),
                          "eos_token_id": info.eos_token_id},
            "max_token_id": max(p["max_token_id"] for p in parts), "append_eos": append_eos,
            "document_order": ("file order" if workers == 1 else
                               f"line i packed by worker i mod {workers}, each in file order")
                              + " (rows are shuffled by the training pipeline)",
            "source_files": [os.path.abspath(f) for f in files],
            "lines": sum(p["lines"] for p in parts),
            "skipped_lines": len(skipped), "skipped_first": skipped[:20],
        }
        with open(os.path.join(tmp, data_lib.PACKED_META), "w") as f:
            json.dump(meta, f, indent=1)
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.pretokenize",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="JSONL files (the formats of train/data.py)")
    p.add_argument("--tokenizer", required=True, help="folder with tokenizer.json")
    p.add_argument("--out", required=True, help="output folder (data.packed_dir)")
    p.add_argument("--seq-len", type=int, required=True, help="packed row length (data.seq_len)")
    p.add_argument("--shard-rows", type=int, default=DEFAULT_SHARD_ROWS, help="rows per shard")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed lines instead of stopping")
    p.add_argument("--no-append-eos", action="store_true",
                   help="do not end pretraining documents with EOS (data.append_eos=false)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--workers", type=int, default=1,
                   help="processes, each packing every WORKERS-th line into its own shards")
    a = p.parse_args(argv)
    try:
        meta = pretokenize(a.files, a.tokenizer, a.out, a.seq_len, shard_rows=a.shard_rows,
                           skip_bad_lines=a.skip_bad_lines, append_eos=not a.no_append_eos,
                           force=a.force, workers=a.workers)
    except (data_lib.DataError, CheckpointError) as e:
        print(f"pretokenize: error: {e}", file=sys.stderr)
        return 2
    if meta["skipped_lines"]:
        print(f"pretokenize: skipped {meta['skipped_lines']} malformed line(s); first: "
              f"{meta['skipped_first'][0]}", file=sys.stderr)
    print(f"pretokenize: {meta['lines'] - meta['skipped_lines']} documents -> {meta['total_rows']} "
          f"rows of {meta['seq_len']} in {len(meta['shards'])} shard(s) at {os.path.abspath(a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
