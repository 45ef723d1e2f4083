"""The demo model's whole pipeline in one command, for a target: one GPU, or any CPU at toy size.

    python -m demo.pipeline --target gpu --out runs/demo [--force]     # one H100/H200, ~6 minutes
    python -m demo.pipeline --target toy --out runs/demo_toy [--force] # any CPU, ~2 minutes: the
                                                                       # same stages, a tiny model

Stages, each timed (OUT/stages.json), each a program a user runs the same way:
  data      python -m demo.data            generated tasks + stdlib code, tokenizer, held-out eval set
  pack      python -m train.data.pretokenize    the training split packed into rows, one process a core
  pretrain  wedlm-train configs/demo_pretrain.yaml   AR only, from scratch; exported to HF
  convert   wedlm-convert hf-to-orbax, orbax-to-hf   the pretrained model there and back: the
                                           tensors and config.json must come back identical
  adapt     wedlm-train configs/demo_adapt.yaml      WeDLM adaptation (dual stream + AR loss) of the
                                           round-tripped model; its steps sized from the pretraining
                                           step time measured a stage earlier to fill its seconds
  package   wedlm-convert                  the adapted model as bf16 safetensors shards of <= 15 MB
                                           (OUT/model), what ships
  heldout   python -m demo.heldout         AR, streaming and verified on the held-out prompts of
                                           each regime, from the shipped bf16 files
  report    OUT/model/report.json          settings, stage times, both stages' metrics, the held-out
                                           results and the eval items (OUT/model: all that ships, 7 files)

OUT/model is what ships; `python -m demo.ship --from OUT/model`
turns it into demo/model (loss curves, the card's tables, the manifest). The train stages log
masked-slot accuracy beside the AR reading's next-token accuracy (`masked_accuracy`,
`ar_accuracy`); the report keeps each stage's last logged values of both.

On a GPU machine (Python with jax for CUDA, flax, optax, orbax, tokenizers, safetensors, and
grain with two of its needs and qwix; a machine without network access installs those from the
wheels `make offline-wheels` downloads, with `pip install --no-index .whl/*.whl`):

    python -m demo.pipeline --target gpu --out runs/demo

(also in the model card, demo/model/README.md). The GPU target's sizes come from a
rehearsal on a CPU: the data stage at full size (100 MB of text, 70M tokens), both train steps
compiled for an H100 with XLA's GPU compiler (26 GiB of 80 each), and the toy target under
Python 3.12 with the GPU machine's jax.

An OUT that exists is refused unless --force (then only a folder this pipeline made is replaced);
free space is checked before the first byte is written. A stage that fails stops the pipeline with
its name and exit code (exit 1); bad options exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OWNED = ".demo-pipeline"


@dataclasses.dataclass(frozen=True)
class Target:
    """Everything a target sizes: data, the two train stages' overrides of the shipped configs,
    the adaptation's seconds, the held-out evaluation."""
    workers: int                    # data generation and packing processes
    train_mb: float                 # generated training text, millions of characters
    eval_args: tuple                # demo.data's held-out set sizes
    pretrain: tuple                 # wedlm-train overrides of configs/demo_pretrain.yaml
    adapt: tuple                    # ... of configs/demo_adapt.yaml
    adapt_seconds: float | None     # adaptation steps = these seconds over its estimated step
    adapt_steps_range: tuple        # (fewest, most) adaptation steps
    heldout_items: int
    heldout_batch: int
    free_gb: float                  # needed under OUT before anything is written


TINY_MODEL = ("model.config.hidden_size=64", "model.config.intermediate_size=128",
              "model.config.num_layers=2", "model.config.num_heads=2", "model.config.head_dim=32")
TARGETS = {
    # one H100 / H200 (16 host cores): the shipped configs as they are, ~6 minutes in all
    "gpu": Target(workers=16, train_mb=100.0, eval_args=(), pretrain=(), adapt=(),
                  adapt_seconds=80.0, adapt_steps_range=(300, 3000), heldout_items=64,
                  heldout_batch=64, free_gb=4.0),
    # any CPU: every stage on a tiny model and a small data set (proves the pipeline, not the model)
    "toy": Target(workers=2, train_mb=0.3,
                  eval_args=("--eval-count", "4", "--eval-arith", "4", "--eval-lists", "4",
                             "--eval-records", "4", "--eval-code", "4"),
                  pretrain=TINY_MODEL + ("steps=12", "optimizer.warmup_steps=2", "data.seq_len=128",
                                         "data.global_batch_size=8", "compute_dtype=f32",
                                         "log_every=4"),
                  adapt=("data.seq_len=128", "data.global_batch_size=8", "optimizer.warmup_steps=2",
                         "compute_dtype=f32", "log_every=4"),
                  adapt_seconds=None, adapt_steps_range=(8, 8), heldout_items=2, heldout_batch=2,
                  free_gb=0.2),
}


class PipelineError(RuntimeError):
    """A stage failed or an option cannot work; the message names it."""


def run(target: Target, out: str, force: bool = False, log=print) -> dict:
    """Every stage into `out`; returns the report (also OUT/model/report.json)."""
    out = os.path.abspath(out)
    prepare_out(out, force, target.free_gb)
    times = {}

    def stage(name, fn, *args):
        log(f"=== {name}")
        t0 = time.perf_counter()
        result = fn(*args)
        times[name] = round(time.perf_counter() - t0, 1)
        log(f"=== {name}: {times[name]} s")
        with open(os.path.join(out, "stages.json"), "w") as f:
            json.dump(times, f, indent=1)
        return result

    data, model = os.path.join(out, "data"), os.path.join(out, "model")
    stage("data", command, "data", [sys.executable, "-m", "demo.data", "--out", data, "--force",
                                    "--workers", str(target.workers), "--train-mb",
                                    str(target.train_mb), *target.eval_args])
    pretrain = load_stage_config("demo_pretrain.yaml", target.pretrain)
    stage("pack", command, "pack", [sys.executable, "-m", "train.data.pretokenize",
                                    os.path.join(data, "train.jsonl"), "--tokenizer",
                                    os.path.join(data, "tokenizer"), "--out",
                                    os.path.join(data, "packed"), "--seq-len",
                                    str(pretrain.data.seq_len), "--workers", str(target.workers)])
    stage("pretrain", train, "pretrain", out, target.pretrain)
    stage("convert", round_trip, out)
    steps = adapt_steps(target, out)
    stage("adapt", train, "adapt", out, target.adapt + (f"steps={steps}",))
    stage("package", package, out, model)
    heldout = os.path.join(out, "heldout.json")
    stage("heldout", command, "heldout", [
        sys.executable, "-m", "demo.heldout", "--model", model, "--eval",
        os.path.join(data, "eval.jsonl"), "--items", str(target.heldout_items), "--batch",
        str(target.heldout_batch), "--out", heldout])
    report = write_report(out, times, steps)
    log(f"model folder: {model} ({len(os.listdir(model))} files, "
        f"{sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model)) / 2**20:.1f} MiB)")
    return report


# ----------------------------------------------------------------------------------- the stages

def prepare_out(out: str, force: bool, free_gb: float) -> None:
    """Refuse an OUT this pipeline did not make, or one it made without --force; check the free
    space; then start it afresh."""
    from wedlm_jax.runtime.failures import check_space
    if os.path.lexists(out):
        if not os.path.isdir(out) or (os.listdir(out) and not os.path.exists(os.path.join(out, OWNED))):
            raise PipelineError(f"{out} exists and was not made by this pipeline (no {OWNED}); "
                                f"refusing to replace it: move it away or pass another --out")
        if os.listdir(out) and not force:
            raise PipelineError(f"{out} holds an earlier run; pass --force to replace it")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    check_space(parent, int(free_gb * 1e9), "the demo pipeline's data, checkpoints and model")
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    open(os.path.join(out, OWNED), "w").close()


def command(name: str, argv: list[str], cpu: bool = False) -> None:
    """Run one stage's program from the repository root (`cpu`: on the host's CPU, not the
    accelerator: the converter's work is file I/O); a failure names the stage."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    rc = subprocess.run(argv, cwd=ROOT, env=env).returncode
    if rc != 0:
        raise PipelineError(f"stage {name} failed (exit {rc}): {' '.join(argv)}")


def convert_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "wedlm_jax.convert", *args, "--force", "--no-progress"]


def load_stage_config(name: str, overrides):
    from train.config import load_config
    return load_config(os.path.join(ROOT, "configs", name), list(overrides))


def train(name: str, out: str, overrides) -> None:
    """One train stage: configs/demo_<name>.yaml on the packed data, checkpoints and metrics in
    OUT/<name>, the final params exported to OUT/<name>/hf."""
    d = os.path.join(out, name)
    argv = [sys.executable, "-m", "train.main", "--config",
            os.path.join(ROOT, "configs", f"demo_{name}.yaml"), "--no-progress",
            f"data.packed_dir={os.path.join(out, 'data', 'packed')}",
            f"data.tokenizer={os.path.join(out, 'data', 'tokenizer')}",
            f"checkpoint.dir={d}", f"checkpoint.export_hf={os.path.join(d, 'hf')}", *overrides]
    if name == "adapt":
        argv.append(f"model.from_hf={os.path.join(out, 'pretrain', 'hf_roundtrip')}")
    command(name, argv)


def round_trip(out: str) -> None:
    """The pretrained HF export through Orbax and back: identical tensors, config and tokenizer."""
    d = os.path.join(out, "pretrain")
    command("convert", convert_cmd("hf-to-orbax", "--hf", os.path.join(d, "hf"), "--out",
                                   os.path.join(d, "orbax")), cpu=True)
    command("convert", convert_cmd("orbax-to-hf", "--orbax", os.path.join(d, "orbax"), "--out",
                                   os.path.join(d, "hf_roundtrip")), cpu=True)
    same_checkpoint(os.path.join(d, "hf"), os.path.join(d, "hf_roundtrip"))


def same_checkpoint(a: str, b: str) -> None:
    import numpy as np

    from wedlm_jax.safetensors_io import index_tensors, read_tensor
    ta, tb = index_tensors(a), index_tensors(b)
    if ta.keys() != tb.keys():
        raise PipelineError(f"convert round trip: tensors differ: {sorted(set(ta) ^ set(tb))[:5]}")
    for k in ta:
        if not np.array_equal(read_tensor(ta[k]), read_tensor(tb[k])):
            raise PipelineError(f"convert round trip changed {k}")
    ca, cb = (json.load(open(os.path.join(x, "config.json"))) for x in (a, b))
    if ca != cb:
        raise PipelineError(f"convert round trip changed config.json: "
                            f"{sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))}")
    if not os.path.exists(os.path.join(b, "tokenizer.json")):
        raise PipelineError("convert round trip: tokenizer.json did not travel")


def adapt_steps(target: Target, out: str) -> int:
    """The adaptation's steps: its seconds over its step time, estimated from the pretraining's
    measured median step and the two steps' FLOPs; within the target's range."""
    lo, hi = target.adapt_steps_range
    if target.adapt_seconds is None:
        return lo
    import statistics

    from train.step import model_flops_per_row
    pre = load_stage_config("demo_pretrain.yaml", target.pretrain)
    ada = load_stage_config("demo_adapt.yaml", target.adapt)
    rows = [r for r in read_jsonl(os.path.join(out, "pretrain", "metrics.jsonl"))
            if not r.get("includes_compile")]
    if not rows:
        return lo
    mc = _model_config(pre)
    flops = lambda c: model_flops_per_row(mc, c.data.seq_len, c.objective.kind,
                                          c.objective.block_size) * c.data.global_batch_size
    step_s = statistics.median(r["step_time_s"] for r in rows) * flops(ada) / flops(pre)
    return int(min(hi, max(lo, target.adapt_seconds / step_s)))


def _model_config(cfg):
    from train.config import model_config
    return model_config(cfg)


def package(out: str, model: str) -> None:
    """The adapted model as the shipped files: bf16 safetensors shards of at most 15 MB."""
    hf = os.path.join(out, "adapt", "hf")
    orb = os.path.join(out, "adapt", "orbax")
    command("package", convert_cmd("hf-to-orbax", "--hf", hf, "--out", orb), cpu=True)
    command("package", convert_cmd("orbax-to-hf", "--orbax", orb, "--out", model, "--dtype", "bf16",
                                   "--max-shard-size", "15MB"), cpu=True)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_report(out: str, times: dict, adapt_steps_run: int) -> dict:
    """OUT/model/report.json: what the model card and `make demo` need from the run."""
    import jax
    stages = {}
    for name in ("pretrain", "adapt"):
        rows = read_jsonl(os.path.join(out, name, "metrics.jsonl"))
        keep = ("loss", "ar_loss", "mlm_loss", "ar_accuracy", "masked_accuracy")
        stages[name] = {"config": json.load(open(os.path.join(out, name, "hf", "config.json"))),
                        "settings": settings(out, name), "metrics": rows,
                        "final": {k: rows[-1].get(k) for k in keep} if rows else {}}
    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device_name(), "jax": jax.__version__, "stage_seconds": times,
        "adapt_steps": adapt_steps_run, "stages": stages,
        "data": json.load(open(os.path.join(out, "data", "stats.json"))),
        "heldout": json.load(open(os.path.join(out, "heldout.json"))),
        "eval_items": read_jsonl(os.path.join(out, "data", "eval.jsonl")),
    }
    path = os.path.join(out, "model", "report.json")
    with open(path + ".partial", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".partial", path)
    return report


def settings(out: str, name: str) -> dict:
    """The stage's resolved config as its last checkpoint saved it (the run's own record)."""
    from train.checkpoint import read_config
    d = os.path.join(out, name)
    steps = [int(n) for n in os.listdir(d) if n.isdigit()]
    return read_config(d, max(steps)) if steps else {}


def device_name() -> str:
    """The accelerator this machine has, without starting a JAX backend (nvidia-smi), else the CPU."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    import platform
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, choices=sorted(TARGETS),
                   help="gpu: one H100/H200, the shipped configs; toy: any CPU, a tiny model")
    p.add_argument("--out", required=True, help="the run's folder (its model/ is what ships)")
    p.add_argument("--force", action="store_true", help="replace an earlier run of this pipeline")
    a = p.parse_args(argv)
    try:
        run(TARGETS[a.target], a.out, a.force)
    except PipelineError as e:
        print(f"demo.pipeline: {e}", file=sys.stderr)
        return 1 if str(e).startswith("stage ") else 2
    except OSError as e:                      # the disk check, a folder that cannot be made
        print(f"demo.pipeline: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
