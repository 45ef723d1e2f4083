"""Ship the trained demo model into the repository (issue 5, step iv).

    python -m demo.ship [--runs runs/demo] [--data data/demo] [--out demo/model]
                                   [--continued DIR [DIR ...]]

Copies the adapted model's HF export (config.json, model.safetensors, tokenizer files) and the
held-out eval prompts, draws the loss curves of both training stages from their metrics.jsonl as
PNGs, writes training.json (steps, tokens, wall time per stage, final losses) and MANIFEST.sha256
(what `make demo` checks before loading). The model card (README.md in the folder) is kept if it
exists. The folder is built beside the target and swapped in whole: an interrupted run leaves the
previous one intact.

--continued names further adaptation runs, in order, each started from the previous one's HF export
(`wedlm-train --config configs/demo_adapt.yaml model.from_hf=... checkpoint.dir=DIR
checkpoint.export_hf=DIR/hf metrics_file=DIR/metrics.jsonl`); the last one's export is shipped,
their settings go into training.json and their curves continue the adaptation curve.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from demo.eval import DEMO_MODEL, write_manifest

COPY = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json")


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise SystemExit(f"demo_ship: {path} is missing (run demo/pipeline.sh first)")
    return [json.loads(line) for line in open(path) if line.strip()]


def stage_seconds(runs: str) -> dict:
    """Wall seconds of the newest real run of each stage (RUNS/stages.tsv)."""
    out = {}
    path = os.path.join(runs, "stages.tsv")
    if os.path.exists(path):
        for line in open(path):
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 4 and parts[1] == "real":
                out[parts[2]] = float(parts[3])
    return out


def run_settings(run: str) -> dict:
    """Start point, data order and LR schedule of a training run, from its newest checkpoint's saved config."""
    steps = sorted((int(d) for d in os.listdir(run) if d.isdigit()), reverse=True)
    for step in steps:
        path = os.path.join(run, str(step), "config", "metadata")
        if os.path.exists(path):
            c = json.load(open(path))
            o = c["optimizer"]
            return dict(from_hf=c["model"]["from_hf"], shuffle_seed=c["data"]["shuffle_seed"],
                        lr=o["lr"], final_lr=o["final_lr"], warmup_steps=o["warmup_steps"])
    raise SystemExit(f"demo_ship: {run} has no checkpoint with a saved config (config/metadata)")


def chain(stages: list[list[dict]]) -> tuple[list[dict], list[int]]:
    """Concatenate the metrics of consecutive runs on one step axis; also the steps where each later run starts."""
    rows, starts, offset = [], [], 0
    for i, stage in enumerate(stages):
        if i:
            starts.append(offset)
        rows += [dict(r, step=r["step"] + offset) for r in stage]
        offset += stage[-1]["step"]
    return rows, starts


def plot_losses(rows: list[dict], keys: tuple, title: str, path: str, marks: list[int] = ()) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if k in r and r[k] > 0]
        if pts:
            ax.plot(*zip(*pts), label=k)
    for m in marks:
        ax.axvline(m, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("step" + (" (dashed: a continued run starts)" if marks else ""))
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary(rows: list[dict], seconds: float | None) -> dict:
    last = rows[-1]
    steady = [r["step_time_s"] for r in rows if not r.get("includes_compile")]
    tokens = [r["tokens"] for r in rows if "tokens" in r]
    return dict(steps=last["step"],
                tokens_per_step=round(sum(tokens) / len(tokens)) if tokens else None,
                final={k: round(float(last[k]), 4) for k in
                                           ("loss", "ar_loss", "mlm_loss", "masked_accuracy") if k in last},
                median_step_s=round(sorted(steady)[len(steady) // 2], 3) if steady else None,
                stage_wall_s=seconds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m demo.ship", description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="runs/demo")
    ap.add_argument("--data", default="data/demo")
    ap.add_argument("--out", default=DEMO_MODEL)
    ap.add_argument("--continued", nargs="+", default=[], metavar="DIR",
                    help="further adaptation runs, in order; the last one's DIR/hf is shipped")
    args = ap.parse_args(argv)
    hf = os.path.join(args.continued[-1] if args.continued else os.path.join(args.runs, "adapt"), "hf")
    for name in COPY[:4]:
        if not os.path.exists(os.path.join(hf, name)):
            raise SystemExit(f"demo_ship: {os.path.join(hf, name)} is missing (the adapt stage of "
                             "demo/pipeline.sh writes it)")
    eval_path = os.path.join(args.data, "eval.jsonl")
    if not os.path.exists(eval_path):
        raise SystemExit(f"demo_ship: {eval_path} is missing (python -m demo.data --out {args.data})")
    pre = read_metrics(os.path.join(args.runs, "pretrain", "metrics.jsonl"))
    ada = read_metrics(os.path.join(args.runs, "adapt", "metrics.jsonl"))
    more = [read_metrics(os.path.join(d, "metrics.jsonl")) for d in args.continued]
    secs = stage_seconds(args.runs)
    continued = [dict(run=d, **run_settings(d), **summary(m, secs.get("continue:" + os.path.basename(d.rstrip("/")))))
                 for d, m in zip(args.continued, more)]
    ada_all, marks = chain([ada] + more)

    out = os.path.abspath(args.out)
    parent = os.path.dirname(out)
    tmp = tempfile.mkdtemp(prefix=".demo_model.", dir=parent)
    try:
        for name in COPY:
            src = os.path.join(hf, name)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(tmp, name))
        shutil.copyfile(eval_path, os.path.join(tmp, "eval.jsonl"))
        for name in ("README.md",):
            if os.path.exists(os.path.join(out, name)):
                shutil.copyfile(os.path.join(out, name), os.path.join(tmp, name))
        plot_losses(pre, ("ar_loss",), "stage 1: AR pretraining (configs/demo_pretrain.yaml)",
                    os.path.join(tmp, "loss_pretrain.png"))
        plot_losses(ada_all, ("loss", "mlm_loss", "ar_loss"),
                    "stage 2: WeDLM adaptation (configs/demo_adapt.yaml)", os.path.join(tmp, "loss_adapt.png"),
                    marks)
        stats_path = os.path.join(args.data, "stats.json")
        info = dict(pretrain=summary(pre, secs.get("pretrain")), adapt=summary(ada, secs.get("adapt")),
                    adapt_continued=continued,
                    data=json.load(open(stats_path)) if os.path.exists(stats_path) else None)
        with open(os.path.join(tmp, "training.json"), "w") as f:
            json.dump(info, f, indent=1)
        for name, src in (("metrics_pretrain.jsonl", os.path.join(args.runs, "pretrain", "metrics.jsonl")),
                          ("metrics_adapt.jsonl", os.path.join(args.runs, "adapt", "metrics.jsonl")),
                          *((f"metrics_adapt_more{i + 1}.jsonl", os.path.join(d, "metrics.jsonl"))
                            for i, d in enumerate(args.continued))):
            shutil.copyfile(src, os.path.join(tmp, name))
        write_manifest(tmp)
        old = None
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=".demo_model.old.", dir=parent)
            os.rename(out, os.path.join(old, "x"))
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"shipped {hf} -> {out}")
    print(json.dumps({k: v for k, v in info.items() if k != "data"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
