"""Sizing the demo model (issue 20 item 2): short AR pretraining runs of a few candidate shapes /
vocabularies / batch sizes on the demo data, each scored on held-out prompts (fresh numbers, AR
greedy) at several points of its run, so the full run's shape is chosen from measured curves.

    python -m benchmarks.demo_sweep [--candidates A,B,C,D] [--out runs/demo_sweep]
                                    [--items 32] [--evals 3]

Each candidate is `configs/demo_pretrain.yaml` with the overrides in CANDIDATES and its own data
folder (`python -m demo.data --vocab-size V`, built once per vocabulary under --out). A run saves a
checkpoint at `--evals` evenly spaced steps; each is restored and decoded (AR greedy, one batch per
regime) on the first --items held-out counting and arithmetic prompts. Results: --out/results.jsonl
(one line per candidate and step: exact accuracy per regime, wall seconds of training so far,
tokens seen) and a markdown table on stdout (pasted into demo/model/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BASE = ["optimizer.warmup_steps=30", "optimizer.lr=3e-3", "optimizer.final_lr=1e-4",
        "log_every=10", "checkpoint.export_hf=null"]
# name: (vocab, steps, overrides). Steps are picked so each run takes about 5-6 minutes here.
def _shape(h, mlp, layers, heads, kv, batch=16, head_dim=64, lr=None):
    return [f"model.config.hidden_size={h}", f"model.config.intermediate_size={mlp}",
            f"model.config.num_layers={layers}", f"model.config.num_heads={heads}",
            f"model.config.num_kv_heads={kv}", f"model.config.head_dim={head_dim}",
            f"data.global_batch_size={batch}"] + ([f"optimizer.lr={lr}"] if lr else [])


# name: (vocab, steps, overrides); steps give each run about 5 minutes of training on this CPU
# (measured step times, batch 16 x 256: A 2.2 s, B 0.95 s, C 1.45 s).
CANDIDATES = {
    "A": (512, 130, _shape(256, 768, 6, 4, 2)),      # the old demo's body, small vocabulary
    "B": (512, 250, _shape(192, 512, 4, 3, 1)),
    "C": (512, 200, _shape(192, 576, 6, 3, 1)),
    "D": (2048, 280, _shape(192, 512, 4, 3, 1)),     # B with a 4x larger vocabulary
    # fourth run (2026-11-24): B's body with 6 query and 6 KV heads of 32 (one KV head is what every
    # digit-routing pattern shared); B at twice the learning rate
    "E": (512, 230, _shape(192, 512, 4, 6, 6, head_dim=32)),
    "G": (512, 250, _shape(192, 512, 4, 3, 1, lr=6e-3)),
    # fifth run (2026-11-25): B's body at smaller batches, so the hour holds more optimizer steps
    # (run 4 said the worked arithmetic is learned after a number of steps, abruptly)
    "H": (512, 450, _shape(192, 512, 4, 3, 1, batch=8)),
    "I": (512, 800, _shape(192, 512, 4, 3, 1, batch=4, lr=2e-3)),
}
KINDS = ("counting", "arith")


def data_folder(out: str, vocab: int) -> str:
    folder = os.path.join(out, f"data_v{vocab}")
    if not os.path.exists(os.path.join(folder, "stats.json")):
        subprocess.run([sys.executable, "-m", "demo.data", "--out", folder, "--force",
                        "--vocab-size", str(vocab)], check=True)
    return folder


def restore_params(step_dir: str):
    import orbax.checkpoint as ocp
    state = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(step_dir, "state")))
    return state["params"]


def score(params, config, tok, data: str, items: int) -> dict:
    """Per regime: exact accuracy of AR greedy, and the NLL per character of the true continuation
    (teacher-forced; a smooth measure while exact accuracy is still 0, comparable across vocabularies)."""
    from decode.config import DecodeConfig
    from demo.eval import REGIMES, ar_nll, decode_items, eval_items
    out = {}
    for kind in KINDS:
        its = eval_items(os.path.join(data, "eval.jsonl"), kind, items)
        dc = DecodeConfig(method="ar", max_new_tokens=REGIMES[kind].max_new_tokens)
        r = decode_items(params, config, tok, its, kind, dc, batch=len(its), warmup=False)
        out[f"{kind}_exact"] = r["accuracy"]
        pairs = [(tok.encode(it["prompt"]), tok.encode(it["target"])) for it in its]
        nll = ar_nll(params, config, pairs)      # per token; per character compares vocabularies
        out[f"{kind}_nll"] = round(sum(n * len(c) for n, (_, c) in zip(nll, pairs))
                                   / sum(len(it["target"]) for it in its), 4)
    return out


def rescore(out: str, items: int) -> list[dict]:
    """Score every kept checkpoint of the finished candidates again (results_rescored.jsonl)."""
    from decode.text import load_tokenizer
    from train.config import load_config, model_config
    rows = []
    old = {(r["candidate"], r["step"]): r for r in map(json.loads, open(os.path.join(out, "results.jsonl")))}
    for (name, step), r in sorted(old.items()):
        vocab, _, overrides = CANDIDATES[name]
        cfg = load_config("configs/demo_pretrain.yaml", [f"model.config.vocab_size={vocab}",
                                                         *[o for o in overrides if o.startswith("model.")]])
        data = data_folder(out, vocab)
        tok = load_tokenizer(os.path.join(data, "tokenizer"))
        acc = score(restore_params(os.path.join(out, name, str(step))), model_config(cfg), tok, data, items)
        rows.append(dict(r, **acc))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(out, "results_rescored.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def run_candidate(name: str, out: str, items: int, evals: int) -> list[dict]:
    vocab, steps, overrides = CANDIDATES[name]
    data = data_folder(out, vocab)
    run = os.path.join(out, name)
    every = max(1, steps // evals)
    cmd = ["wedlm-train", "--config", "configs/demo_pretrain.yaml", "--no-progress",
           f"data.train_files=[{data}/train.jsonl]", f"data.tokenizer={data}/tokenizer",
           f"model.config.vocab_size={vocab}", f"steps={steps}", f"checkpoint.dir={run}",
           f"checkpoint.every={every}", f"checkpoint.keep={evals + 1}", *BASE, *overrides]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    wall = time.time() - t0
    metrics = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if l.strip()]

    from decode.text import load_tokenizer
    from train.config import load_config, model_config
    cfg = load_config("configs/demo_pretrain.yaml",
                      [f"model.config.vocab_size={vocab}", *[o for o in overrides if o.startswith("model.")]])
    config = model_config(cfg)
    tok = load_tokenizer(os.path.join(data, "tokenizer"))
    rows = []
    batch = next(int(o.split("=")[1]) for o in overrides if o.startswith("data.global_batch_size"))
    for s in sorted(int(d) for d in os.listdir(run) if d.isdigit()):
        acc = score(restore_params(os.path.join(run, str(s))), config, tok, data, items)
        row = dict(candidate=name, vocab=vocab, params=config.num_params(), step=s, batch=batch,
                   tokens=s * batch * cfg.data.seq_len, train_wall_s=round(wall * s / steps, 1),
                   overrides=overrides, last_loss=next((m.get("loss") for m in reversed(metrics)
                                                        if m["step"] <= s and "loss" in m), None),
                   **acc)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.demo_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--out", default="runs/demo_sweep")
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--evals", type=int, default=3)
    ap.add_argument("--rescore", action="store_true",
                    help="score the kept checkpoints of --out again (exact + NLL) and print the table")
    a = ap.parse_args(argv)
    if a.rescore:
        print_table(rescore(a.out, a.items))
        return 0
    names = a.candidates.split(",")
    bad = [n for n in names if n not in CANDIDATES]
    if bad:
        print(f"demo_sweep: unknown candidate {bad[0]!r}; candidates: {', '.join(CANDIDATES)}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for n in names:
        if os.path.exists(os.path.join(a.out, n)):
            print(f"demo_sweep: {a.out}/{n} exists; remove it to run {n} again", file=sys.stderr)
            return 2
        new = run_candidate(n, a.out, a.items, a.evals)
        rows += new
        with open(os.path.join(a.out, "results.jsonl"), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print("| candidate | vocab | params | batch | step | tokens | train wall s | loss | "
          + " | ".join(f"{k} exact | {k} NLL" for k in KINDS) + " |")
    print("|---|---|---|---|---|---|---|---|" + "---|---|" * len(KINDS))
    for r in rows:
        print(f"| {r['candidate']} | {r['vocab']} | {r['params'] / 1e6:.2f}M | {r['batch']} | {r['step']} | "
              f"{r['tokens'] / 1e6:.2f}M | {r['train_wall_s']:.0f} | {r['last_loss']:.3f} | "
              + " | ".join(f"{100 * r[f'{k}_exact']:.0f}% | {r.get(f'{k}_nll', float('nan')):.3f}"
                           for k in KINDS) + " |")


if __name__ == "__main__":
    sys.exit(main())
