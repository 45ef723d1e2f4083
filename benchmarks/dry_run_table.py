"""Dry-run figures of the paper-scale train steps, compiled ahead of time on this CPU.

    python -m benchmarks.dry_run_table table --models 8b,7b --out benchmarks/results/dry_run_table.json
    python -m benchmarks.dry_run_table layers --out benchmarks/results/dry_run_layers.json
    python -m benchmarks.dry_run_table compile-time --before-root /tmp/main_tree --reps 2 \\
        --out benchmarks/results/compile_time_8b.json

`table`: one process with 64 forced CPU devices; for each model (configs/wedlm_8b_from_qwen3.yaml,
configs/wedlm_7b_from_qwen25.yaml with the architecture-only configs/arch/*), each fsdp in
--fsdp (data=1, tensor=1: the mesh is the first fsdp devices) and each remat policy, the train
step of seq_len 4096 is compiled from abstract shapes (`train.dry_run.compile_step`, the program
`wedlm-train --dry-run` compiles) with `rows` rows per device per microbatch (global batch =
rows x fsdp x grad_accum, grad_accum as in the config: 4), and XLA's per-device memory analysis is
recorded. The largest rows that fit each budget (--budgets GiB): for the policies of
--search-remat, a search seeded with the linear fit of rows 1 and 2 and checked by compiling at
the boundary (r fits, r + 1 does not); for the others, the linear fit of rows 1 and 2.

`compile-time`: the lowering + compile time of the 8B step at fsdp=8 (1 row per device, remat on),
for the tree under --before-root (e.g. `git archive main`: the Python-loop model) and this tree,
interleaved (before, after, before, after, ...), each in a fresh process; medians reported. It uses
only `train.step` functions both trees have.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from wedlm_jax import compiled as compiled_lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GIB = 1024 ** 3
MODELS = {"8b": ("configs/wedlm_8b_from_qwen3.yaml", "configs/arch/qwen3-8b"),
          "7b": ("configs/wedlm_7b_from_qwen25.yaml", "configs/arch/qwen2.5-7b")}


def _machine() -> str:
    import jax
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax "
            f"{jax.__version__}")


# --------------------------------------------------------------------------------------- table

def _cfg(model: str, fsdp: int, remat: str, rows: int, seq_len: int):
    from train.config import load_config
    path, arch = MODELS[model]
    cfg = load_config(os.path.join(ROOT, path), [f"model.from_hf={os.path.join(ROOT, arch)}"])
    accum = cfg.optimizer.grad_accum
    return load_config(os.path.join(ROOT, path), [
        f"model.from_hf={os.path.join(ROOT, arch)}", f"data.seq_len={seq_len}",
        f"data.global_batch_size={rows * fsdp * accum}", "mesh.data=1", f"mesh.fsdp={fsdp}",
        "mesh.tensor=1", f"remat={remat}"])


def measure(model: str, fsdp: int, remat: str, rows: int, seq_len: int, cache: dict) -> dict:
    key = (model, fsdp, remat, rows)
    if key not in cache:
        import jax
        from train import dry_run
        cfg = _cfg(model, fsdp, remat, rows, seq_len)
        mc = dry_run.model_config_for(cfg)
        compiled, lower_s, compile_s, _ = dry_run.compile_step(cfg, mc, jax.devices()[:fsdp])
        mem = compiled_lib.memory(compiled)
        del compiled
        cache[key] = {"model": model, "fsdp": fsdp, "remat": remat, "rows": rows,
                      "seq_len": seq_len, "grad_accum": cfg.optimizer.grad_accum,
                      "lower_s": lower_s, "compile_s": compile_s,
                      **{f"{k}_bytes": v for k, v in mem.items()}}
        print(json.dumps(cache[key]), flush=True)
    return cache[key]


def largest_rows(model, fsdp, remat, seq_len, budget_gib, cache, limit=64) -> int:
    """The largest rows per device whose total fits `budget_gib` (0 if even 1 row does not)."""
    fits = lambda r: measure(model, fsdp, remat, r, seq_len, cache)["total_bytes"] <= budget_gib * GIB
    if not fits(1):
        return 0
    t1 = measure(model, fsdp, remat, 1, seq_len, cache)["total_bytes"]
    t2 = measure(model, fsdp, remat, 2, seq_len, cache)["total_bytes"]
    guess = 1 + int((budget_gib * GIB - t1) // max(t2 - t1, 1))
    lo, hi = 1, None  # lo fits; hi (when known) does not
    r = max(1, min(guess, limit))
    while True:
        if fits(r):
            lo = max(lo, r)
            if hi is None:
                if r >= limit:
                    return r
                r = r + 1
                continue
        else:
            hi = r if hi is None else min(hi, r)
        if hi is not None and hi == lo + 1:
            return lo
        r = (lo + hi) // 2 if hi is not None else r + 1


def table(args) -> None:
    cache: dict = {}
    out = {"machine": _machine(), "command": " ".join(sys.argv), "seq_len": args.seq_len,
           "budgets_gib": args.budgets, "cells": [], "measurements": None}
    t0 = time.time()
    for model in args.models.split(","):
        for fsdp in args.fsdp:
            for remat in args.remat.split(","):
                one = measure(model, fsdp, remat, 1, args.seq_len, cache)
                cell = {"model": model, "fsdp": fsdp, "remat": remat, "rows1": one,
                        "max_rows": {}}
                two = measure(model, fsdp, remat, 2, args.seq_len, cache)
                cell["per_row_bytes"] = two["total_bytes"] - one["total_bytes"]
                for b in args.budgets:
                    if remat in args.search_remat.split(","):
                        cell["max_rows"][str(b)] = largest_rows(model, fsdp, remat, args.seq_len,
                                                                b, cache)
                    else:  # the linear fit of rows 1 and 2, not checked at the boundary
                        free = b * GIB - one["total_bytes"]
                        cell["max_rows"][str(b)] = (0 if free < 0 else
                                                    1 + int(free // cell["per_row_bytes"]))
                        cell["max_rows_from"] = "linear fit of rows 1 and 2"
                out["cells"].append(cell)
                out["measurements"] = list(cache.values())
                out["elapsed_s"] = time.time() - t0
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(out, f, indent=1)
                print(json.dumps({k: v for k, v in cell.items() if k != "rows1"}), flush=True)


def layers_scaling(args) -> None:
    """Temporaries of the 8B step (fsdp 8, remat full) at --rows rows for several layer counts:
    with the layer scan they grow with the rows and barely with the layers."""
    import dataclasses

    import jax
    import yaml
    from train import dry_run
    from train.config import load_config
    from wedlm_jax.config import ModelConfig
    path, arch = MODELS["8b"]
    base = ModelConfig.from_hf(os.path.join(ROOT, arch))
    out = {"machine": _machine(), "command": " ".join(sys.argv), "runs": []}
    for layers in args.layers:
        fields = dataclasses.asdict(base.replace(num_layers=layers))
        fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items()}
        for rows in args.rows:
            cfg = load_config(os.path.join(ROOT, path), [
                # YAML flow style: 1e-06 in JSON would read back as a string in YAML
                "model.from_hf=null",
                "model.config=" + yaml.safe_dump(fields, default_flow_style=True).strip(),
                f"data.seq_len={args.seq_len}", f"data.global_batch_size={rows * 8 * 4}",
                "mesh.data=1", "mesh.fsdp=8", "remat=full"])
            compiled, lower_s, compile_s, _ = dry_run.compile_step(
                cfg, dry_run.model_config_for(cfg), jax.devices()[:8])
            r = {"num_layers": layers, "rows": rows, "compile_s": compile_s,
                 **{f"{k}_bytes": v for k, v in compiled_lib.memory(compiled).items()}}
            out["runs"].append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


# -------------------------------------------------------------------------------- compile time

ONCE = """
import json, sys, time
import jax, jax.numpy as jnp
from train import step as step_lib
from train.config import load_config, model_config
cfg = load_config(sys.argv[1], sys.argv[2:])
mc = model_config(cfg)
from wedlm_jax.sharding import make_mesh
mesh = make_mesh(1, cfg.mesh.fsdp, 1)
opt = step_lib.make_optimizer(cfg)
sh = step_lib.state_shardings(mc, opt, mesh)
bsh = step_lib.batch_shardings(mesh)
b, n = cfg.data.global_batch_size, cfg.data.seq_len
batch = {k: jax.ShapeDtypeStruct((b,) if k == "index" else (b, n),
                                 jnp.bool_ if k == "maskable" else jnp.int32, sharding=bsh[k])
         for k in step_lib.BATCH_KEYS}
fn = step_lib.make_train_step(cfg, mc, opt, mesh, sh, cfg.objective.mask_token_id)
t0 = time.perf_counter()
with jax.set_mesh(mesh):
    lowered = fn.jitted.lower(step_lib.state_shapes(mc, opt, sh), batch)
t1 = time.perf_counter()
m = lowered.compile().memory_analysis()
t2 = time.perf_counter()
print("RESULT", json.dumps({"lower_s": t1 - t0, "compile_s": t2 - t1,
      "argument_bytes": m.argument_size_in_bytes, "temp_bytes": m.temp_size_in_bytes}))
"""


def compile_once(root: str, fsdp: int) -> dict:
    overrides = [f"model.from_hf={os.path.join(ROOT, MODELS['8b'][1])}", "remat=true",
                 f"mesh.fsdp={fsdp}", "mesh.data=1", f"data.global_batch_size={4 * fsdp}"]
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={fsdp}")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", ONCE, os.path.join(root, MODELS["8b"][0]),
                        *overrides], cwd=root, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"compile in {root} failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.split("RESULT", 1)[1])
    r["process_s"] = time.perf_counter() - t0
    return r


def compile_time(args) -> None:
    runs = {"before": [], "after": []}
    roots = {"before": os.path.abspath(args.before_root), "after": ROOT}
    for i in range(args.reps):
        for name in ("before", "after"):
            r = compile_once(roots[name], args.fsdp_compile)
            r["loadavg"] = os.getloadavg()
            runs[name].append(r)
            print(name, json.dumps(r), flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("lower_s", "compile_s",
                                                                "process_s")}
           for n, rs in runs.items()}
    for n in med:
        med[n]["lower_plus_compile_s"] = statistics.median(r["lower_s"] + r["compile_s"]
                                                           for r in runs[n])
    out = {"machine": _machine(), "command": " ".join(sys.argv), "roots": roots, "runs": runs,
           "median": med, "speedup": med["before"]["lower_plus_compile_s"]
           / med["after"]["lower_plus_compile_s"]}
    print(json.dumps(out["median"]), "speedup", round(out["speedup"], 2), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def markdown(args) -> None:
    """The BENCHMARKS.md table of a `table` JSON."""
    t = json.load(open(args.table))
    budgets = [str(b) for b in t["budgets_gib"]]
    print(f"| model | fsdp | remat | arguments | temporaries | total (1 row) | + per row | "
          + " | ".join(f"max rows <= {float(b):g} GiB" for b in budgets) + " | compile |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(budgets) + "---|")
    for c in t["cells"]:
        one = c["rows1"]
        per = c.get("per_row_bytes")
        fits = [str(c["max_rows"].get(b, "")) + ("" if c["remat"] == "full" else "*")
                for b in budgets]
        print(f"| {c['model']} | {c['fsdp']} | {c['remat']} | {one['argument_bytes'] / GIB:.2f} | "
              f"{one['temp_bytes'] / GIB:.2f} | {one['total_bytes'] / GIB:.2f} | "
              f"{'' if per is None else f'{per / GIB:.2f}'} | " + " | ".join(fits)
              + f" | {one['lower_s'] + one['compile_s']:.0f} s |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("--models", default="8b,7b")
    t.add_argument("--fsdp", type=int, nargs="+", default=[8, 16, 64])
    t.add_argument("--remat", default="full,save_dots,none")
    t.add_argument("--search-remat", default="full",
                   help="remat policies whose largest batch is searched and checked at the "
                        "boundary (the others: linear fit of rows 1 and 2)")
    t.add_argument("--budgets", type=float, nargs="+", default=[80.0, 95.0])
    t.add_argument("--seq-len", type=int, default=4096)
    t.add_argument("--out")
    lay = sub.add_parser("layers")
    lay.add_argument("--layers", type=int, nargs="+", default=[9, 18, 36])
    lay.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    lay.add_argument("--seq-len", type=int, default=4096)
    lay.add_argument("--out")
    md = sub.add_parser("markdown")
    md.add_argument("table")
    c = sub.add_parser("compile-time")
    c.add_argument("--before-root", required=True, help="a tree with the old model (git archive)")
    c.add_argument("--reps", type=int, default=2)
    c.add_argument("--fsdp-compile", type=int, default=8)
    c.add_argument("--out")
    args = p.parse_args(argv)
    if args.cmd in ("table", "layers"):
        n = max(args.fsdp) if args.cmd == "table" else 8
        flag = f"--xla_force_host_platform_device_count={n}"
        if flag not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts: re-exec with n devices
            env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
            os.execve(sys.executable, [sys.executable, "-m", "benchmarks.dry_run_table",
                                       *sys.argv[1:]], env)
        table(args) if args.cmd == "table" else layers_scaling(args)
    elif args.cmd == "markdown":
        markdown(args)
    else:
        compile_time(args)


if __name__ == "__main__":
    main()
