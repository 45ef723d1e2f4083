"""The accelerator suite: one command measuring the project against the device's limits.

    python -m benchmarks.compiled.accelerator [--out DIR] [--sections decode,window,prefill,train,convert]
                                     [--model 8b|4b|1.7b|0.6b] [--device-memory-gib G]
    python -m benchmarks.compiled.accelerator --smoke [--out DIR]        # CPU only: tiny shapes, same paths

On the device it finds (GPU or TPU), with random weights generated on the device, bf16:
  probes   peak HBM bandwidth (a jitted copy-like kernel x + 1: reads and writes N bytes) and peak
           matmul FLOP/s (an n x n bf16 matmul), both measured in this run; the device's nominal
           peaks when its kind is in `NOMINAL`.
  decode   the AR step (one slot per row, cache-mode forward on `prefix` committed tokens) at batch
           1, 8 and 64 with every cache-mode attention implementation the platform has, against
           the HBM roofline: (weights read + live KV read) / measured bandwidth, as a percent.
  window   the W-slot step cost relative to the AR step, W = 1, 4, 8, 16, 32, for both refill
           orders: 'after' forwards W slots, 'before' (the official engine's order) up to 2W, so
           forwards of W and 2W slots are timed (the speed-up ceiling on this hardware). It uses
           the implementation with the fastest AR step at batch 1.
  prefill  a cache-mode forward of a `prefill` token prompt from an empty cache: tokens/s, MFU.
  train    the project's train step (train/step.py; dual-stream objective, bf16 compute, remat)
           for a ~1B-shaped model at L = 2048 and 4096 with every attention implementation the
           resolver offers for training structures here: step time, tokens/s, MFU.
  convert  a generated bf16 checkpoint through wedlm_jax.convert: device -> HF safetensors,
           HF -> device, device -> Orbax, Orbax -> device, in GB/s.
Decode / prefill / window are timed as the decode loop runs them (benchmarks.decoding.window_cost.measure:
many forwards in one jitted loop over a donated cache, logits consumed), not through the engine.

Shapes are chosen to fit: the largest decode shape (Qwen3-8B-like down to 0.6B-like) whose memory
estimate fits the device's memory is used (or `--model`, refused with its estimate when it does
not fit); a train or prefill entry whose estimate does not fit is recorded as refused, with the
estimate, and not run. `--smoke` runs every section at tiny shapes on CPU (it is a test of the
suite; its figures say nothing about any hardware) and is refused on an accelerator; without
`--smoke` the suite refuses to run on CPU.

Writes DIR/accelerator.json, DIR/accelerator.md and DIR/*.png (matplotlib, the 'plot' extra;
skipped with a note when missing). DIR must not exist or be empty; files are written to a sibling
temporary folder and moved into place at the end, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from benchmarks.compiled.accelerator_report import gib, markdown, plots, targets
from benchmarks.probes import GIB, device_info, median_time, probe_bandwidth, probe_matmul
from benchmarks.shapes import DECODE_SHAPES, SMOKE_SHAPE, TRAIN_SHAPE, device_params, model_config

SECTIONS = ("decode", "window", "prefill", "train", "convert")
WINDOWS = (1, 4, 8, 16, 32)

class SuiteError(RuntimeError):
    """A run the suite refuses (wrong platform, shape too large, bad output folder)."""


# ------------------------------------------------------------------------------------- plan

@dataclasses.dataclass(frozen=True)
class Plan:
    smoke: bool
    model: str                      # decode / prefill shape name
    decode_config: dict
    train_config: dict
    convert_config: dict
    batches: tuple = (1, 8, 64)
    windows: tuple = WINDOWS
    prefix: int = 1024              # committed tokens in the cache for decode / window
    capacity: int = 1088            # decode cache rows (>= prefix + the largest forward)
    kv_tile: int = 256
    prefill: int = 2048
    train_lengths: tuple = (2048, 4096)
    train_rows: int = 1
    remat: bool = True
    block_size: int = 32
    copy_bytes: int = 2 * GIB
    matmul_n: int = 8192
    repeats: int = 10
    inner: int = 8


def smoke_plan() -> Plan:
    return Plan(smoke=True, model="smoke", decode_config=SMOKE_SHAPE, train_config=SMOKE_SHAPE,
                convert_config=SMOKE_SHAPE, batches=(1, 8), windows=(1, 2), prefix=16,
                capacity=20, kv_tile=16, prefill=32, train_lengths=(32,), remat=False, block_size=8,
                copy_bytes=4 * 1024 ** 2, matmul_n=128, repeats=2, inner=2)


def kv_bytes_per_token(c, itemsize: int = 2) -> int:
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * itemsize


def decode_estimate(c, batch: int, rows: int, slots: int, itemsize: int = 2) -> dict:
    """Bytes a cache-mode forward of `slots` per row needs: weights, the KV cache (`rows` rows),
    the f32 logits (and their argmax pass), activations and the dense path's scores."""
    act = batch * slots * max(c.hidden_size, c.intermediate_size) * 4 * 8
    scores = batch * c.num_heads * slots * rows * 4 * 3
    parts = {"weights": c.num_params() * itemsize,
             "kv_cache": batch * rows * kv_bytes_per_token(c, itemsize),
             "logits": 2 * batch * slots * c.vocab_size * 4,
             "activations": act + scores}
    parts["total"] = int(1.1 * sum(parts.values())) + GIB // 4
    return parts


def train_estimate(c, rows: int, seq_len: int, impl: str) -> dict:
    """Bytes of one train step (dual stream: T = 2L slots; f32 master weights, AdamW moments and
    gradients, the bf16 compute copy; f32 logits with their gradient and softmax; remat keeps
    each layer's input, one layer's activations live at a time; dense attention materialises
    its [T, T] scores, probabilities and their gradient per head)."""
    t = 2 * seq_len
    n = c.num_params()
    layer = rows * t * (c.intermediate_size * 3 + c.hidden_size * 6) * 4
    if impl == "dense":
        layer += rows * c.num_heads * t * t * 4 * 3 + rows * t * t
    else:
        layer += rows * t * c.num_heads * c.head_dim * 4 * 4
    parts = {"state": n * (4 + 4 + 8 + 2), "logits": rows * t * c.vocab_size * 4 * 4,
             "saved_activations": c.num_layers * rows * t * c.hidden_size * 4, "layer": layer}
    parts["total"] = int(1.1 * sum(parts.values())) + GIB // 2
    return parts


def prefill_estimate(c, length: int) -> dict:
    parts = decode_estimate(c, 1, length, length)
    parts["activations"] += c.num_heads * length * length * 4 * 3
    parts["total"] = int(1.1 * sum(v for k, v in parts.items() if k != "total")) + GIB // 4
    return parts


def _explain(parts: dict) -> str:
    return ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if k != "total")


def check_platform(platform: str, smoke: bool) -> None:
    """--smoke is a CPU-only check of the code paths; the real suite needs an accelerator."""
    if smoke and platform != "cpu":
        raise SuiteError(f"--smoke runs the suite at tiny shapes on CPU only; this process sees "
                         f"the {platform!r} backend: run without --smoke to measure it")
    if not smoke and platform == "cpu":
        raise SuiteError("no accelerator here (jax's backend is 'cpu'): run with --smoke for the "
                         "CPU check of the code paths, or on a GPU / TPU to measure")


def make_plan(platform: str, memory: int, *, smoke: bool, model: str | None = None) -> Plan:
    """The plan for a device with `memory` bytes. Raises `SuiteError` (before anything is
    allocated) for --smoke off CPU, no --smoke on CPU, an unknown --model, or a decode shape whose
    estimate at the largest batch does not fit (with the estimate)."""
    check_platform(platform, smoke)
    if smoke:
        plan = smoke_plan()
        candidates = [("smoke", plan.decode_config)]
    else:
        if model is not None and model not in DECODE_SHAPES:
            raise SuiteError(f"--model must be one of {', '.join(DECODE_SHAPES)}; got {model!r}")
        plan = Plan(smoke=False, model="", decode_config={}, train_config=TRAIN_SHAPE,
                    convert_config=DECODE_SHAPES["1.7b"])
        names = [model] if model else list(DECODE_SHAPES)
        candidates = [(n, DECODE_SHAPES[n]) for n in names]
    rows = plan.capacity + 2 * max(plan.windows)
    budget = int(0.9 * memory)
    tried = []
    for batches in (plan.batches, plan.batches[:-1]):    # the largest batch goes first
        if not batches:
            break
        for name, fields in candidates:
            est = decode_estimate(model_config(fields), max(batches), rows, 1)
            if est["total"] <= budget:
                return dataclasses.replace(plan, model=name, decode_config=fields,
                                           batches=batches)
            tried.append(f"{name} at batch {max(batches)}: {gib(est['total'])} "
                         f"({_explain(est)})")
    raise SuiteError(f"no decode shape fits the device memory ({gib(memory)}, 90% usable = "
                     f"{gib(budget)}) with {rows} cache rows; estimates: " + "; ".join(tried))


# ---------------------------------------------------------------------------------- sections

def cache_backends(platform: str, interpret: bool = False) -> list[str]:
    import jax.numpy as jnp

    from wedlm_jax.attention import backends as ab
    return ab.available("cache", backend=platform, dtype=jnp.bfloat16, interpret=interpret)


def failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def failures(report: dict) -> list[str]:
    """'section: what failed' for every entry that raised (recorded, not fatal)."""
    out = []
    for name in ("decode", "prefill", "train"):
        out += [f"{name} {r.get('attention')}: {r['failed']}" for r in report.get(name, [])
                if "failed" in r]
    for name in ("window", "convert"):
        if "failed" in (report.get(name) or {}):
            out.append(f"{name}: {report[name]['failed']}")
    return out


def run_decode(plan: Plan, info: dict, params, bandwidth: float) -> list[dict]:
    import jax.numpy as jnp

    from benchmarks.decoding.window_cost import measure
    c = model_config(plan.decode_config)
    weights = (c.num_params() - (0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size)) * 2
    out = []
    for impl in cache_backends(info["platform"]):
        for b in plan.batches:
            try:
                t = measure(c, params, [1], plan.prefix, plan.capacity, plan.kv_tile,
                            plan.repeats, plan.inner, batch=b, attention=impl,
                            dtype=jnp.bfloat16)[1]
            except Exception as e:              # one kernel failing must not lose the others
                out.append({"attention": impl, "batch": b, "failed": failure(e)})
                continue
            kv = b * (plan.prefix + 1) * kv_bytes_per_token(c)
            ideal = (weights + kv) / bandwidth
            out.append({"attention": impl, "batch": b, "prefix": plan.prefix, "step_s": t,
                        "weights_bytes": weights, "kv_bytes": kv, "roofline_s": ideal,
                        "roofline_pct": 100.0 * ideal / t, "tokens_per_s": b / t})
    return out


def run_window(plan: Plan, params, impl: str) -> dict:
    import jax.numpy as jnp

    from benchmarks.decoding.window_cost import measure
    c = model_config(plan.decode_config)
    sizes = sorted(set(plan.windows) | {2 * w for w in plan.windows})
    t = measure(c, params, sizes, plan.prefix, plan.capacity, plan.kv_tile, plan.repeats,
                plan.inner, batch=1, attention=impl, dtype=jnp.bfloat16)
    ar = t[1]
    return {"attention": impl, "prefix": plan.prefix, "forward_s": {str(k): v for k, v in t.items()},
            "after": {str(w): t[w] / ar for w in plan.windows},
            "before": {str(w): t[2 * w] / ar for w in plan.windows}}


def run_prefill(plan: Plan, info: dict, params, peak: float) -> list[dict]:
    import jax.numpy as jnp

    from benchmarks.decoding.window_cost import measure
    from train import step as step_lib
    c = model_config(plan.decode_config)
    est = prefill_estimate(c, plan.prefill + 1)
    flops = step_lib.model_flops_per_row(c, plan.prefill, "ar_only") / 3.0
    out = []
    for impl in cache_backends(info["platform"]):
        row = {"attention": impl, "tokens": plan.prefill, "estimate_bytes": est["total"]}
        if est["total"] > 0.9 * info["memory_bytes"]:
            row["refused"] = f"estimate {gib(est['total'])} ({_explain(est)}) > 90% of {gib(info['memory_bytes'])}"
        else:
            try:
                t = measure(c, params, [plan.prefill], 0, plan.prefill, plan.kv_tile,
                            max(2, plan.repeats // 2), 1, batch=1, attention=impl,
                            dtype=jnp.bfloat16)[plan.prefill]
            except Exception as e:
                row["failed"] = failure(e)
                out.append(row)
                continue
            row.update(step_s=t, tokens_per_s=plan.prefill / t, model_flops=flops,
                       mfu_probe=flops / t / peak,
                       mfu_nominal=(flops / t / info["nominal_bf16_flops"]
                                    if info["nominal_bf16_flops"] else None))
        out.append(row)
    return out


def train_backends(platform: str) -> tuple[list[str], dict]:
    """Implementations the resolver offers for training structures here, and why the others
    (of dense, tiled, cudnn, splash, pallas) are not run."""
    import jax.numpy as jnp

    from wedlm_jax.attention import backends as ab
    run, why = [], {}
    for impl in ("dense", "tiled", "cudnn", "splash", "pallas"):
        try:
            ab.resolve(impl, "structure", backend=platform, dtype=jnp.bfloat16)
            run.append(impl)
        except ab.AttentionUnavailable as e:
            why[impl] = str(e)
    return run, why


def run_train(plan: Plan, info: dict, peak: float, attention=None) -> list[dict]:
    """The train step timed with each attention implementation the resolver offers here, or
    those of them in `attention` (names; None: all)."""
    import jax
    import jax.numpy as jnp

    from train import step as step_lib
    from train.config import load_config
    from wedlm_jax.sharding import make_mesh
    c = model_config(plan.train_config)
    fields = dict(plan.train_config, mask_token_id=c.vocab_size - 1)
    impls, why = train_backends(info["platform"])
    impls = [i for i in impls if attention is None or i in attention]
    out = [{"attention": impl, "skipped": reason} for impl, reason in why.items()
           if attention is None or impl in attention]
    mc = model_config(fields)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    first = {}                      # the initial f32 params, made once (the step donates its state)
    for seq_len in plan.train_lengths:
        for impl in impls:
            est = train_estimate(c, plan.train_rows, seq_len, impl)
            row = {"attention": impl, "seq_len": seq_len, "rows": plan.train_rows,
                   "params": c.num_params(), "estimate_bytes": est["total"]}
            out.append(row)
            if est["total"] > 0.9 * info["memory_bytes"]:
                row["refused"] = (f"estimate {gib(est['total'])} ({_explain(est)}) > 90% of "
                                  f"{gib(info['memory_bytes'])}")
                continue
            cfg = load_config(None, [
                "model.config=" + json.dumps(fields), "data.train_files=[unused.jsonl]",
                f"data.seq_len={seq_len}", f"data.global_batch_size={plan.train_rows}",
                "steps=1000", "optimizer.lr=1e-4", "optimizer.final_lr=1e-5",
                "optimizer.warmup_steps=10", f"objective.block_size={plan.block_size}",
                "compute_dtype=bf16", f"remat={str(plan.remat).lower()}", f"attention={impl}"])
            opt = step_lib.make_optimizer(cfg)
            sh = step_lib.state_shardings(mc, opt, mesh)
            if "params" not in first:
                first["params"] = step_lib.init_params_sharded(mc, 0, sh)
            state = step_lib.init_state(jax.tree.map(jnp.copy, first["params"]), opt, sh)
            fn = step_lib.make_train_step(cfg, mc, opt, mesh, sh, mc.mask_token_id)
            rng = np.random.default_rng(0)
            r = plan.train_rows
            bsh = step_lib.batch_shardings(mesh)
            batch = {"tokens": rng.integers(0, mc.vocab_size - 1, (r, seq_len)).astype(np.int32),
                     "segment_ids": np.ones((r, seq_len), np.int32),
                     "maskable": np.ones((r, seq_len), bool), "index": np.arange(r, dtype=np.int32)}
            batch = {k: jax.device_put(v, bsh[k]) for k, v in batch.items()}
            holder = {"state": state}

            def one():
                holder["state"], m = fn(holder["state"], batch)  # noqa: F821 - bound above, in this loop
                return m["loss"]
            try:
                t = median_time(one, max(2, plan.repeats // 3))
            except Exception as e:
                row["failed"] = failure(e)
                continue
            flops = step_lib.model_flops_per_row(mc, seq_len, "dual_stream", plan.block_size) * r
            row.update(step_s=t, tokens_per_s=r * seq_len / t, model_flops=flops,
                       mfu_probe=flops / t / peak,
                       mfu_nominal=(flops / t / info["nominal_bf16_flops"]
                                    if info["nominal_bf16_flops"] else None))
            del holder, state, fn
    return out


def run_convert(plan: Plan, workdir: str) -> dict:
    import jax

    from wedlm_jax import convert
    c = model_config(dict(plan.convert_config, mask_token_id=None))
    params = device_params(c, seed=1)
    root = tempfile.mkdtemp(prefix="wedlm-accel-convert-", dir=workdir)
    hf, orbax = os.path.join(root, "hf"), os.path.join(root, "orbax")
    try:
        timings = {}
        t0 = time.perf_counter()
        convert.save_hf_checkpoint(c, params, hf, dtype="bf16", progress=False)
        timings["device_to_hf"] = time.perf_counter() - t0
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(hf) for f in fs)
        t0 = time.perf_counter()
        _, loaded = convert.load_hf_checkpoint(hf, progress=False)
        jax.block_until_ready(loaded)
        timings["hf_to_device"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        convert.save_orbax(c, loaded, orbax)
        timings["device_to_orbax"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, again = convert.load_orbax(orbax)
        jax.block_until_ready(again)
        timings["orbax_to_device"] = time.perf_counter() - t0
        same = all(bool((a == b).all()) for a, b in
                   zip(jax.tree.leaves(params), jax.tree.leaves(again)))
        if not same:
            raise SuiteError("conversion round trip changed the parameters")
        return {"params": c.num_params(), "checkpoint_bytes": size, "seconds": timings,
                "gb_per_s": {k: size / v / 1e9 for k, v in timings.items()},
                "round_trip_equal": same}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def prepare_out(out: str) -> str:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise SuiteError(f"--out {out} already exists and is not an empty folder; choose another")
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".accelerator-", dir=parent)


# -------------------------------------------------------------------------------------- main

def run(args) -> dict:
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SuiteError(f"--sections takes {', '.join(SECTIONS)}; got {', '.join(bad)}")
    info = device_info(args.device_memory_gib)
    plan = make_plan(info["platform"], info["memory_bytes"], smoke=args.smoke, model=args.model)
    out = args.out or os.path.join("benchmarks", "results", "accelerator",
                                   f"{info['platform']}-{time.strftime('%Y%m%d-%H%M%S')}")
    tmp = prepare_out(out)
    try:
        report = {"command": "python -m benchmarks.compiled.accelerator " + " ".join(args.argv),
                  "device": info, "plan": dataclasses.asdict(plan),
                  "decode_params": model_config(plan.decode_config).num_params(),
                  "train_params": model_config(plan.train_config).num_params()}
        print(f"[accelerator] {info['device_kind']} ({info['platform']}), memory "
              f"{gib(info['memory_bytes'])}, decode shape {plan.model}", file=sys.stderr)
        clock = {"t": time.perf_counter()}
        report["section_s"] = {}

        def done(name):
            now = time.perf_counter()
            report["section_s"][name] = now - clock["t"]
            clock["t"] = now
            print(f"[accelerator] {name}: {report['section_s'][name]:.1f} s", file=sys.stderr,
                  flush=True)

        bw = probe_bandwidth(plan.copy_bytes, plan.repeats)
        peak = probe_matmul(plan.matmul_n, plan.repeats)
        report["probes"] = {"bandwidth_bytes_per_s": bw, "matmul_flops": peak,
                            "copy_bytes": plan.copy_bytes}
        done("probes")
        params = None
        if {"decode", "window", "prefill"} & set(sections):
            params = device_params(model_config(plan.decode_config))
            done("weights")
        if "decode" in sections:
            report["decode"] = run_decode(plan, info, params, bw)
            done("decode")
        if "window" in sections:
            best = min((r for r in report.get("decode", []) if r["batch"] == 1 and "step_s" in r),
                       key=lambda r: r["step_s"], default={"attention": "tiled"})["attention"]
            try:
                report["window"] = run_window(plan, params, best)
            except Exception as e:
                report["window"] = {"attention": best, "failed": failure(e)}
            done("window")
        if "prefill" in sections:
            report["prefill"] = run_prefill(plan, info, params, peak)
            done("prefill")
        del params
        if "train" in sections:
            report["train"] = run_train(plan, info, peak)
            done("train")
        if "convert" in sections:
            try:
                report["convert"] = run_convert(plan, args.workdir or tempfile.gettempdir())
            except Exception as e:
                report["convert"] = {"failed": failure(e)}
            done("convert")
        report["targets"] = targets(report)
        report["failures"] = failures(report)
        report["plots"] = plots(report, tmp)
        with open(os.path.join(tmp, "accelerator.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(tmp, "accelerator.md"), "w") as f:
            f.write(markdown(report))
        if os.path.isdir(out):
            os.rmdir(out)                                          # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report["out"] = out
    return report


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU: a check of the code paths (refused off CPU)")
    p.add_argument("--out", help="output folder (must not exist or be empty); default "
                                 "benchmarks/results/accelerator/<platform>-<time>")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--model", help=f"decode/prefill shape, one of {', '.join(DECODE_SHAPES)} "
                                   f"(default: the largest that fits)")
    p.add_argument("--device-memory-gib", type=float,
                   help="plan for this much device memory instead of the device's own")
    p.add_argument("--workdir", help="where the conversion checkpoint is written (default: tmp)")
    args = p.parse_args(argv)
    args.argv = argv
    try:
        report = run(args)
    except SuiteError as e:
        print(f"benchmarks.compiled.accelerator: error: {e}", file=sys.stderr)
        return 2
    print(markdown(report))
    print(f"[accelerator] wrote {report['out']}", file=sys.stderr)
    if report["failures"]:
        print("benchmarks.compiled.accelerator: error: some entries failed (recorded in the report):\n  "
              + "\n  ".join(report["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
