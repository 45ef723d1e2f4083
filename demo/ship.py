"""Ship a finished demo pipeline run into the repository as demo/model.

    python -m demo.ship [--from runs/demo/model] [--out demo/model]

`--from` is the pipeline's model folder (demo/pipeline.py: bf16 safetensors shards, config,
tokenizer and report.json). Copied: the model and tokenizer files;
written from report.json: eval.jsonl (the held-out items the run was judged on), the two stages'
metrics (metrics_pretrain.jsonl, metrics_adapt.jsonl) and loss curves (PNG), training.json (where,
how long, the stages' settings and final losses and accuracies, the held-out results, the data);
then MANIFEST.sha256, what `make demo` checks before loading. The model card (README.md) is kept.
The folder is built beside the target and swapped in whole: an interrupted run leaves the
previous one intact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from demo.eval import DEMO_MODEL, write_manifest

REPORT = "report.json"
NEEDED = ("config.json", "tokenizer.json", "tokenizer_config.json", REPORT)


class ShipError(RuntimeError):
    """A run folder that cannot be shipped; the message names the file."""


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
    ax.set_ylabel("loss (nats / token)" if "loss" in keys[0] else "accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)



def check_run(src: str) -> dict:
    """report.json of a pipeline's model folder, after checking every file the demo needs is there."""
    for name in NEEDED:
        if not os.path.isfile(os.path.join(src, name)):
            raise ShipError(f"{os.path.join(src, name)} is missing (python -m demo.pipeline writes "
                            f"it into OUT/model)")
    if not any(n.endswith(".safetensors") for n in os.listdir(src)):
        raise ShipError(f"{src}: no .safetensors file (python -m demo.pipeline writes them)")
    with open(os.path.join(src, REPORT)) as f:
        report = json.load(f)
    for key in ("stages", "eval_items", "heldout", "stage_seconds"):
        if key not in report:
            raise ShipError(f"{os.path.join(src, REPORT)}: no {key!r} (not a pipeline report)")
    return report


def training_summary(report: dict) -> dict:
    """training.json: the report without its per-step metrics and eval items."""
    stages = {}
    for name, st in report["stages"].items():
        rows = st["metrics"]
        steady = sorted(r["step_time_s"] for r in rows if not r.get("includes_compile"))
        stages[name] = dict(steps=rows[-1]["step"] if rows else 0, final=st["final"],
                            median_step_s=steady[len(steady) // 2] if steady else None,
                            settings=st["settings"])
    keep = ("created", "device", "jax", "stage_seconds", "adapt_steps", "data", "heldout")
    return dict({k: report.get(k) for k in keep}, stages=stages)


def model_files(src: str) -> list[str]:
    """The files of src that make the model: config, tokenizer, weights (a run's logs stay out)."""
    return sorted(n for n in os.listdir(src) if os.path.isfile(os.path.join(src, n)) and (
        n in ("config.json", "tokenizer.json", "tokenizer_config.json")
        or n.endswith(".safetensors") or n == "model.safetensors.index.json"))


def write_folder(src: str, tmp: str, report: dict) -> None:
    for name in model_files(src):
        shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, "eval.jsonl"), "w") as f:
        for item in report["eval_items"]:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    for name, st in report["stages"].items():
        with open(os.path.join(tmp, f"metrics_{name}.jsonl"), "w") as f:
            for row in st["metrics"]:
                f.write(json.dumps(row) + "\n")
    pre, ada = report["stages"]["pretrain"]["metrics"], report["stages"]["adapt"]["metrics"]
    plot_losses(pre, ("ar_loss",), "stage 1: AR pretraining (configs/demo_pretrain.yaml)",
                os.path.join(tmp, "loss_pretrain.png"))
    plot_losses(ada, ("loss", "mlm_loss", "ar_loss"),
                "stage 2: WeDLM adaptation (configs/demo_adapt.yaml)", os.path.join(tmp, "loss_adapt.png"))
    with open(os.path.join(tmp, "training.json"), "w") as f:
        json.dump(training_summary(report), f, indent=1)


def ship(src: str, out: str) -> dict:
    """demo/model (`out`) from a pipeline's model folder, swapped in whole; returns the summary."""
    report = check_run(src)
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    tmp = tempfile.mkdtemp(prefix=".demo_model.", dir=parent)
    try:
        write_folder(src, tmp, report)
        if os.path.exists(os.path.join(out, "README.md")):
            shutil.copyfile(os.path.join(out, "README.md"), os.path.join(tmp, "README.md"))
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
    return training_summary(report)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m demo.ship", description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="src", default="runs/demo/model",
                    help="the pipeline's model folder (default runs/demo/model)")
    ap.add_argument("--out", default=DEMO_MODEL)
    args = ap.parse_args(argv)
    try:
        info = ship(args.src, args.out)
    except (ShipError, OSError, ValueError) as e:
        print(f"demo.ship: {e}", file=sys.stderr)
        return 2
    print(f"shipped {args.src} -> {os.path.abspath(args.out)}")
    print(json.dumps({k: v for k, v in info.items() if k not in ("data", "heldout")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
