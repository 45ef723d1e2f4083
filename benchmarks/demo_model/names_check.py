"""Do the records' names stay learnable? The data recipes side by side at toy size, on a CPU.

    python -m benchmarks.demo_model.names_check [--out runs/names_check] [--recipes 1,2]
        [--tokenizer-mb 2] [--train-mb 1] [--steps 800] [--items 32] [--json FILE]

Per data recipe (demo/tasks.py RECIPES: 1 drew the names from 26, 2 composes them from
syllables), two measurements:

  tokenizer  the pipeline's data stage (demo.data.build) at the default mix, `--tokenizer-mb`
             million characters, its tokenizer trained on all of them (vocab 512, as the GPU
             target): of the names of the held-out records, the fraction that are ONE token, and
             the mean tokens a name
  training   the pipeline's stages on records alone (data at `--train-mb`, its own tokenizer,
             packing, then `configs/demo_pretrain.yaml` shrunk: hidden 128, 2 layers, MLP 256,
             seq 256, batch 8, f32, `--steps` AR steps); then AR greedy on `--items` held-out records:
             the names it wrote (distinct), the rows whose name is the table's (the copy rate),
             and the records right whole

Everything under --out (a folder per recipe); the figures are printed and, with --json, written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from demo import data as dd
from demo import pipeline

TOY_MODEL = ("model.config.hidden_size=128", "model.config.intermediate_size=256",
             "model.config.num_layers=2", "model.config.num_heads=4",
             "model.config.num_kv_heads=2", "model.config.head_dim=32")
NAME = re.compile(r'"name": "([^"]*)"')


def table_names(prompt: str) -> list[str]:
    """The name column of a records prompt's table, row by row."""
    rows = prompt.split("\n")[2:-2]
    return [r.split(" | ", 1)[0] for r in rows]


def token_counts(tokenizer_dir: str, names) -> list[int]:
    """Tokens of each name as the table and the JSON both hold it (no space before it)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    return [len(tok.encode(n, add_special_tokens=False).ids) for n in names]


def tokenizer_figures(folder: str, recipe: int, mb: float, items: int) -> dict:
    """The default mix at `mb` million characters, its tokenizer on all of them: how the
    held-out records' names tokenize."""
    dd.build(folder, force=True, train_mb=mb, tokenizer_mb=mb, recipe=recipe,
             eval_sizes=dict(counting=1, arith=1, lists=1, records=items, code=1),
             log=lambda *a: None)
    return tokenizer_figures_of(folder)


def train_records(run: str, recipe: int, mb: float, steps: int, items: int) -> str:
    """The pipeline's data, pack and pretrain stages on records alone; returns the HF export."""
    data = os.path.join(run, "data")
    dd.build(data, force=True, train_mb=mb, tokenizer_mb=mb, recipe=recipe,
             mix=dd.parse_mix("records=1"),
             eval_sizes=dict(counting=1, arith=1, lists=1, records=items, code=1),
             log=lambda *a: None)
    pipeline.command("pack", [sys.executable, "-m", "train.data.pretokenize",
                              os.path.join(data, "train.jsonl"), "--tokenizer",
                              os.path.join(data, "tokenizer"), "--out",
                              os.path.join(data, "packed"), "--seq-len", "256", "--workers", "2"])
    pipeline.train("pretrain", run, TOY_MODEL + (
        f"steps={steps}", f"optimizer.warmup_steps={max(1, min(30, steps // 10))}", "data.seq_len=256",
        "data.global_batch_size=8", "compute_dtype=f32", "log_every=50", "time_limit_s=null",
        "attention=dense"))
    return os.path.join(run, "pretrain", "hf")


def name_figures(hf: str, eval_path: str, items: int) -> dict:
    """AR greedy on the held-out records: the names written against the tables'."""
    from decode.config import DecodeConfig
    from demo.eval import decode_items, eval_items, load_model
    config, params, tok = load_model(hf, check=False)
    its = eval_items(eval_path, "records", items)
    dc = DecodeConfig(method="ar", max_new_tokens=128)
    res = decode_items(params, config, tok, its, "records", dc, batch=len(its), warmup=False)
    written, rows, copied = [], 0, 0
    for it, row in zip(its, res["rows"]):
        want, got = table_names(it["prompt"]), NAME.findall(row["text"])
        written += got
        rows += len(want)
        copied += sum(w == g for w, g in zip(want, got))
    return {"items": len(its), "rows": rows, "names_written": len(written),
            "distinct_names_written": len(set(written)), "name_copy_rate": copied / rows,
            "records_right": res["accuracy"], "examples": [r["text"] for r in res["rows"][:2]]}


def check(recipe: int, a) -> dict:
    run = os.path.join(os.path.abspath(a.out), f"recipe{recipe}")
    t0 = time.perf_counter()
    out = {"tokenizer": tokenizer_figures(os.path.join(run, "mix"), recipe, a.tokenizer_mb, a.items)}
    if a.steps > 0:
        hf = train_records(os.path.join(run, "records"), recipe, a.train_mb, a.steps, a.items)
        out["train_tokenizer"] = tokenizer_figures_of(os.path.join(run, "records", "data"))
        out["decode"] = name_figures(hf, os.path.join(run, "records", "data", "eval.jsonl"), a.items)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def tokenizer_figures_of(data: str) -> dict:
    """How a built data folder's tokenizer splits its held-out records' names."""
    evals = pipeline.read_jsonl(os.path.join(data, "eval.jsonl"))
    names = sorted({n for e in evals if e["kind"] == "records" for n in table_names(e["prompt"])})
    counts = token_counts(os.path.join(data, "tokenizer"), names)
    return {"names": len(names), "single_token": sum(c == 1 for c in counts) / len(counts),
            "tokens_per_name": sum(counts) / len(counts)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.demo_model.names_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/names_check")
    p.add_argument("--recipes", default="1,2", help="data recipes to compare (demo/tasks.py)")
    p.add_argument("--tokenizer-mb", type=float, default=2.0)
    p.add_argument("--train-mb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=800, help="AR steps (0: the tokenizer only)")
    p.add_argument("--items", type=int, default=32, help="held-out records items")
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args(argv)
    results = {}
    for recipe in (int(r) for r in a.recipes.split(",")):
        results[recipe] = check(recipe, a)
        print(f"recipe {recipe}: {json.dumps(results[recipe], indent=1)}", flush=True)
    if a.json:
        meta = {"command": "python -m benchmarks.demo_model.names_check " + " ".join(argv or sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d")}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
