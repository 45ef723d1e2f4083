"""Mixtures of packed folders (e.g. 70% web, 30% code), read through Grain's `MapDataset.mix`.

`data.packed_dir` may name a mixture file (.yaml, .yml or .json) instead of a folder:

    mixture:
      - {dir: data/web-packed-2048, weight: 0.7}
      - {dir: gs://bucket/code-packed-2048, weight: 0.3}

Every folder is checked as a packed folder (meta.json, shards, seq_len); all must share the
tokenizer (sha256 of tokenizer.json) and append_eos. The weights are the shares of rows drawn:
folder i's rows are shuffled with seed `data.shuffle_seed + i` and repeated (reshuffled each
epoch), and `grain.MapDataset.mix` interleaves those streams in the weights' proportions by
index. Global example index g is element g of the mixed stream, so the order is fixed by the
seed, each process reads its rows of each global batch as with one folder, and the Grain state
saved in a checkpoint resumes it exactly.

`python -m train.data.mixture FILE [--steps N --global-batch B]` prints each folder's row and token
shares (a row of folder i holds on average tokens_i / rows_i non-padding tokens, so the token
shares differ from the weights when the folders pack differently) and how many epochs of each
folder N steps of B rows read. Relative `dir`s are taken from the working directory, like the
config's other paths.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from train.data.pipeline import DataError


def load_mixture_file(path: str) -> list[tuple[str, float]]:
    """[(dir, weight)] of a mixture file; DataError naming the file when malformed."""
    import yaml
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) if not path.lower().endswith(".json") else json.load(f)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise DataError(f"{path}: unreadable mixture file ({str(e).splitlines()[0]})") from None
    items = doc.get("mixture") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise DataError(f"{path}: a mixture file holds `mixture:`, a list of {{dir, weight}}")
    out = []
    for i, it in enumerate(items):
        ok = isinstance(it, dict) and isinstance(it.get("dir"), str) and isinstance(
            it.get("weight"), (int, float)) and not isinstance(it.get("weight"), bool)
        if not ok or not it["weight"] > 0 or set(it) - {"dir", "weight"}:
            raise DataError(f"{path}: mixture[{i}] must be {{dir: FOLDER, weight: NUMBER > 0}}, "
                            f"got {it!r}")
        out.append((it["dir"], float(it["weight"])))
    return out


def read_mixture_meta(path: str, *, seq_len: int | None = None) -> dict:
    """The combined meta of a mixture: {'mixture': [{dir, weight, meta}], seq_len, tokenizer,
    max_token_id, append_eos, lines, total_rows, tokens}; every folder checked."""
    from train.data import packed
    parts = []
    for d, w in load_mixture_file(path):
        if packed.is_mixture(d):
            raise DataError(f"{path}: {d} is itself a mixture file; list its folders instead")
        parts.append({"dir": d, "weight": w, "meta": packed.read_packed_meta(d, seq_len=seq_len)})
    first = parts[0]
    for p in parts[1:]:
        for key, what in ((("seq_len",), "seq_len"), (("tokenizer", "sha256"), "tokenizer.json"),
                          (("append_eos",), "append_eos")):
            a, b = first["meta"], p["meta"]
            for k in key:
                a, b = a.get(k) if isinstance(a, dict) else a, b.get(k) if isinstance(b, dict) else b
            if a != b:
                raise DataError(f"{path}: {p['dir']} and {first['dir']} were packed with a "
                                f"different {what} ({str(b)[:16]} vs {str(a)[:16]})")
    metas = [p["meta"] for p in parts]
    return {"mixture": parts, "seq_len": first["meta"]["seq_len"],
            "tokenizer": first["meta"]["tokenizer"],
            "max_token_id": max(int(m["max_token_id"]) for m in metas),
            "append_eos": first["meta"].get("append_eos", True),
            "lines": sum(int(m.get("lines", 0)) for m in metas),
            "total_rows": sum(int(m["total_rows"]) for m in metas),
            "tokens": sum(int(m.get("tokens", 0)) for m in metas)}


class MixtureRows(dict):
    """The rows of a mixture for `train.data.pipeline.make_pipeline`: `row_stream(seed)` is the mixed
    stream; the keys tokens/segment_ids/maskable are the folders' rows one after the other (their
    length is the mixture's row count)."""

    def __init__(self, meta: dict):
        from train.data import packed
        self.parts = [packed.open_packed(p["dir"], p["meta"]) for p in meta["mixture"]]
        self.weights = [p["weight"] for p in meta["mixture"]]
        super().__init__({k: Concat([p[k] for p in self.parts])
                          for k in ("tokens", "segment_ids", "maskable")})

    def row_stream(self, seed: int):
        import grain
        streams = []
        for i, rows in enumerate(self.parts):
            order = grain.MapDataset.range(len(rows["tokens"])).shuffle(seed=seed + i).repeat()
            streams.append(order.map(lambda src, rows=rows: {
                "tokens": rows["tokens"][src], "segment_ids": rows["segment_ids"][src],
                "maskable": rows["maskable"][src]}))
        return grain.MapDataset.mix(streams, self.weights)


class Concat:
    """Sequences read one after the other."""

    def __init__(self, parts: list):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i):
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k][i - int(self.starts[k])]


def shares(meta: dict, steps: int | None = None, global_batch: int | None = None) -> list[dict]:
    """Per folder: dir, weight, rows, tokens, row_share, token_share and (with steps and
    global_batch) the epochs of it those steps read."""
    parts = meta["mixture"]
    total_w = sum(p["weight"] for p in parts)
    per_row = [int(p["meta"].get("tokens", 0)) / int(p["meta"]["total_rows"]) for p in parts]
    mass = [p["weight"] / total_w * t for p, t in zip(parts, per_row)]
    out = []
    for p, t, m in zip(parts, per_row, mass):
        r = {"dir": p["dir"], "weight": p["weight"], "rows": int(p["meta"]["total_rows"]),
             "tokens": int(p["meta"].get("tokens", 0)), "tokens_per_row": round(t, 1),
             "row_share": p["weight"] / total_w,
             "token_share": m / sum(mass) if sum(mass) else float("nan")}
        if steps and global_batch:
            r["epochs"] = r["row_share"] * steps * global_batch / r["rows"]
        out.append(r)
    return out


def format_shares(rows: list[dict]) -> str:
    lines = [f"{'folder':<40} {'weight':>7} {'rows':>10} {'tok/row':>8} {'row share':>9} "
             f"{'token share':>11}" + (f" {'epochs':>7}" if "epochs" in rows[0] else "")]
    for r in rows:
        lines.append(f"{r['dir'][-40:]:<40} {r['weight']:>7g} {r['rows']:>10} "
                     f"{r['tokens_per_row']:>8} {r['row_share']:>9.1%} {r['token_share']:>11.1%}"
                     + (f" {r['epochs']:>7.2f}" if "epochs" in r else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.data.mixture",
                                description="Check a mixture file and print its row and token "
                                            "shares (reads meta.json and shard indexes only)")
    p.add_argument("mixture", help="the mixture file (data.packed_dir)")
    p.add_argument("--seq-len", type=int, help="check the folders against this data.seq_len")
    p.add_argument("--steps", type=int, help="training steps (prints the epochs of each folder)")
    p.add_argument("--global-batch", type=int, help="data.global_batch_size")
    a = p.parse_args(argv)
    try:
        meta = read_mixture_meta(a.mixture, seq_len=a.seq_len)
    except DataError as e:
        print(f"mixture: error: {e}", file=sys.stderr)
        return 2
    print(format_shares(shares(meta, a.steps, a.global_batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
