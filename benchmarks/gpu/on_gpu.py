"""What only a GPU can tell, in one run of a few minutes on one GPU machine.

    python -m benchmarks.gpu.on_gpu --out DIR [--budget-s 420] [--parts torch_baseline,probes,...]
    python -m benchmarks.gpu.on_gpu --smoke --out DIR        # any CPU: tiny shapes, the same paths

On the GPU machine, with its own python, jax (CUDA), torch and transformers, plus qwix (on a machine
without network access, the wheels of `make offline-wheels` copied there and installed with
`pip install --no-index .whl/*.whl`):

    XLA_PYTHON_CLIENT_MEM_FRACTION=.92 python -m benchmarks.gpu.on_gpu --out DIR --budget-s 480 \
      --trace 2>&1 | tee DIR/log.txt

It writes on_gpu.json, torch_baseline.json, up to 4 traces and log.txt; results are kept in
benchmarks/results/<card>-<date>/ (on_gpu.json's "card" names it). The default parts, as measured
on an H100 (2026-11-28): torch_baseline ~150 s (its torch.compile took 56-62 s a batch size),
probes ~3 s, qmatmul ~30 s, admit ~70 s, train ~40 s, then steps on what is left (~30 s a
setting's compile, then the rounds; in STEP_SETTINGS' order; the rest skip, named in the report,
for a later run: --parts probes,steps --settings ...). The latest results: BENCHMARKS.md section 8.

Parts, each skipped when the run's time budget, less the least time of the parts after it
(PART_S), cannot hold it (what ran is written to DIR/on_gpu.json after every part, so a run cut
short keeps its figures; the card, its driver and the versions are written before the first):
  torch_baseline  the PyTorch peer (benchmarks.gpu.torch_baseline), in a process of its own and
           before any JAX part (JAX holds the card's memory from its first part on):
           transformers' Qwen3 of the 8B shape, random bf16 weights, static KV cache, the decode
           step under torch.compile (reduce-overhead: CUDA graphs), AR at batch 1 and 8 with
           2048-token prompts, interleaved rounds, medians; stopped after TORCH_MAX_S.
  probes   the card's HBM bandwidth (x + 1 over 4 GiB: bytes read + written) and bf16 matmul rate
           (8192^3), measured here: the roofline the step times are read against.
  kernel   every cache-attention backend the platform offers (Triton kernel, cuDNN, tiled XLA)
           and the paged gather path against the dense reference in float32 at HIGHEST
           precision, on random K/V and ragged cache lengths, at the 8B model's head layout for
           1, 16 and 32 query slots: relative error, NaN never (benchmarks.gpu.on_gpu_kernels).
  kernel_time  each Triton kernel (dense cache in place; paged) at 1, 4 and 16 splits of the
           live rows and the paged gather path, alone: microseconds per layer and the live K/V
           GB/s at batch 1 and 8, 2K and 16K live rows, 1 and 16 query slots (KERNEL_POINTS).
  qmatmul  the grouped int4 matmul kernel (wedlm_jax.grouped_matmul) at the 8B projections'
           shapes (QMATMUL_POINTS): its error against the dequantized kernel's float32 matmul,
           and its time alone (the int4 values' and scales' GB/s against the copy rate).
  tokens   the demo model decoded greedy on this GPU by the Decoder with each cache layout and
           backend (dense tiled / dense Triton / paged 64), against the same Decoder on this
           machine's CPU: sequences equal, first difference.
  admit    the admission as served (benchmarks.gpu.on_gpu_admit): time to first token of one 2K
           prompt and of 8 at once (one after another, and in one batched prefill), and the
           prefill's MFU.
  train    the train step of the ~1B shape at 4096 tokens a row (dual stream, bf16, remat) with
           the resolver's attention for it (on GPU the flash kernels, attention.flash) and the
           pure-JAX tiled path beside it (--train-attention; benchmarks.compiled.accelerator.run_train):
           step time, tokens/s, MFU against the measured rate (the nominal peak without probes).
  steps    the decode step as served: a Decoder over random bf16 weights of the Qwen3-8B shape
           (the GPU's own layout: one tree per layer; the platform's cache, dense with its Triton
           kernel on GPU, unless the setting names a page size), 1, 8 or 32 slots of capacity
           2048 + 512 each holding a distinct 2048-token prompt, AR and streaming / verified
           windows; each setting compiled while the budget holds it, then all timed in
           interleaved rounds (one `generate` call of 8 steps per setting per round), medians:
           ms per step, step / AR, and the step's floor (weights + live K/V + logits) over the
           copy rate measured in the same process.
At the end the targets (benchmarks.gpu.on_gpu_report.TARGETS: AR against the floor at batch 8 and
1, streaming W16 / AR, AR against the PyTorch peer at batch 1 and 8, the admission's and the
train step's MFU) are read off the rows and printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

from benchmarks.gpu.on_gpu_kernels import (KERNEL_POINTS, KERNEL_SPLITS, kernel,  # noqa: F401
                                       kernel_time, qmatmul)
from benchmarks.gpu.on_gpu_report import card_info, error_line, nvidia_smi, table, targets

PARTS = ("torch_baseline", "probes", "kernel", "kernel_time", "qmatmul", "tokens", "admit", "train",
         "steps")
# the default run: the PyTorch peer first (its own process and GPU memory, before JAX takes
# the card's), the steps last (the part that fits the budget left: settings it cannot hold skip)
DEFAULT_PARTS = ("torch_baseline", "probes", "qmatmul", "admit", "train", "steps")
# seconds a part needs at least on a card, left to the parts after the one running (a part
# skipped when the budget less theirs cannot hold its own); steps: two settings and their rounds
PART_S = dict(torch_baseline=170, probes=10, kernel=160, kernel_time=120, qmatmul=20, tokens=130,
              admit=60, train=90, steps=80)
TORCH_MAX_S = 170        # the PyTorch process is stopped after this (it keeps what it wrote)
SETTING_S = 35           # one step setting's compile on a card (~25 s on an H100) and its start
ROUND_CALL_S = 0.6       # one timed generate call of 8 steps, the slowest setting (b32), about
TRACE_S = 5
# (name, method, window, refill, slots, page_size, attention[, {compiler_options, quantize,
# quantize_group}]), compiled in
# this order while the budget holds: the served default (page_size None: the server's cache on
# this platform, paged 64 with the Triton paged kernel on GPU) at batch 8 and the window; the
# window's 128-row projections with XLA's Triton GEMMs only (the autotuner picks cuBLAS for them,
# slower per byte than the AR step's Triton GEMMs: BENCHMARKS.md section 8) and with the
# exhaustive tiling search; the dense cache with its Triton kernel (a static batch's) at both; AR
# at batch 1, batch 32, the window at batch 1 and 32, the paged gather path, verified, the other
# refill, AR with int8 weights and with int4 in groups of 64 (the grouped Triton matmul,
# wedlm_jax.grouped_matmul); the last ones only by --settings or a longer budget
TRITON_GEMMS = {"xla_gpu_cublas_fallback": False}
# XLA:GPU searching every Triton tiling of each GEMM (cuBLAS still among the choices)
TILING_SEARCH = {"xla_gpu_exhaustive_tiling_search": True}
STEP_SETTINGS = (
    ("ar b8", "ar", 1, "after", 8, None, "auto"),
    ("streaming W16 after b8", "streaming", 16, "after", 8, None, "auto"),
    ("streaming W16 after b8 triton gemms", "streaming", 16, "after", 8, None, "auto",
     dict(compiler_options=TRITON_GEMMS)),
    ("streaming W16 after b8 tiling search", "streaming", 16, "after", 8, None, "auto",
     dict(compiler_options=TILING_SEARCH)),
    ("ar b8 dense", "ar", 1, "after", 8, 0, "auto"),
    ("streaming W16 after b8 dense", "streaming", 16, "after", 8, 0, "auto"),
    ("ar b1", "ar", 1, "after", 1, None, "auto"),
    ("ar b32", "ar", 1, "after", 32, None, "auto"),
    ("streaming W16 after b1", "streaming", 16, "after", 1, None, "auto"),
    ("streaming W16 after b32", "streaming", 16, "after", 32, None, "auto"),
    ("ar b8 paged gather", "ar", 1, "after", 8, 64, "tiled"),
    ("verified W16 after b8", "verified", 16, "after", 8, None, "auto"),
    ("streaming W16 before b8", "streaming", 16, "before", 8, None, "auto"),
    ("streaming W8 after b8", "streaming", 8, "after", 8, None, "auto"),
    ("ar b8 int8", "ar", 1, "after", 8, None, "auto", dict(quantize="int8")),
    ("ar b8 int4 g64", "ar", 1, "after", 8, None, "auto", dict(quantize="int4", quantize_group=64)),
)
JAX_PARTS = tuple(p for p in PARTS if p != "torch_baseline")


MAX_TRACES = 4       # profiler traces kept per run (a few MB each)


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def probes(smoke: bool) -> dict:
    from benchmarks.probes import device_info, probe_bandwidth, probe_matmul
    info = device_info()
    bw = probe_bandwidth((4 << 20) if smoke else (4 << 30), 10)
    mm = probe_matmul(128 if smoke else 8192, 10)
    return dict(info, hbm_bytes_per_s=bw, bf16_flops=mm)


def tokens(smoke: bool) -> list[dict]:
    """The demo model's greedy tokens by each Decoder layout on this GPU against its CPU run."""
    import jax

    from decode.config import DecodeConfig, EngineOptions, Placement
    from decode.engine.runtime.decoder import Decoder
    from decode.engine.planning.plan import make_plan
    from decode.static.static_batch import generate
    from demo.eval import eval_items, load_model
    config, params, tok = load_model()
    items = eval_items(os.path.join("demo", "model", "eval.jsonl"), "counting", 8)
    prompts = [tok.encode(it["prompt"]) for it in items]
    out = []
    gpu = jax.devices()[0]
    cpu = jax.devices("cpu")[0]
    for method, window in (("streaming", 8), ("ar", 1), ("verified", 8)):
        dc = DecodeConfig(method=method, window=window, max_new_tokens=24 if smoke else 64)
        cap = max(len(p) for p in prompts) + dc.max_new_tokens

        def run(device, page_size, attention):
            with jax.default_device(device), jax.default_matmul_precision("highest"):
                p = jax.device_put(params, device)
                dec = Decoder(p, make_plan(
                    config, EngineOptions(method=method, window=window, slots=8, capacity=cap,
                                          steps_per_call=8),
                    Placement(page_size=page_size, attention=attention, dtype="float32"),
                    sampling=False))
                return generate(p, config, prompts, dc, decoder=dec).tokens
        try:
            want = run(cpu, 0, "tiled")
        except Exception as e:
            out.append(dict(method=method, layout="cpu reference", failed=error_line(e)))
            continue
        for layout, page_size, attention in (("dense tiled", 0, "tiled"),
                                             ("dense pallas", 0, "pallas"),
                                             ("paged 64", None, "auto")):
            row = dict(method=method, layout=layout)
            try:
                got = run(gpu, page_size, attention)
                row["equal"] = sum(a == b for a, b in zip(got, want))
                row["of"] = len(want)
                row["first_difference"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                                None) for a, b in zip(got, want)]
            except Exception as e:
                row["failed"] = error_line(e)
            out.append(row)
    return out


def _pages_per_tile(n: int) -> None:
    """A probe, not a setting: the paged gather path with `n` pages per tile of its loop."""
    from wedlm_jax.attention import paged as pa
    gather = pa.attend_pages_gather

    def patched(q, pool, table, cache_len, scale, pages_per_tile=4, first_page=0):
        return gather(q, pool, table, cache_len, scale, n, first_page)
    pa.attend_pages_gather = patched


def _trace(dec, st, folder: str, name: str):
    """One `generate` call under jax's profiler; its trace.json.gz copied to folder/name (the
    profiler's own folder is nested several levels deep)."""
    import glob
    import shutil
    import tempfile

    import jax
    tmp = tempfile.mkdtemp()
    with jax.profiler.trace(tmp):
        st, _ = dec.generate(st)
        jax.block_until_ready(st)
    found = glob.glob(os.path.join(tmp, "plugins", "profile", "*", "*.trace.json.gz"))
    if found:
        shutil.copy(found[0], os.path.join(folder, name))
    return st


def trace_summary(path: str, steps: int) -> dict:
    """Per step, from a profiler trace: kernels run on the device, the device busy (ms), the
    share in kernels longer than 5 us (the matmuls) and the device-to-host copies (a loop's
    predicate read each iteration on XLA:GPU). CPU traces have no device rows: zeros."""
    import gzip
    events = json.load(gzip.open(path))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = [e for e in events if e.get("ph") == "X" and "/device:" in names.get(e["pid"], "")]
    n = max(steps, 1)
    return dict(kernels=len(dev) / n, busy_ms=sum(e["dur"] for e in dev) / 1e3 / n,
                long_kernels_ms=sum(e["dur"] for e in dev if e["dur"] > 5) / 1e3 / n,
                device_to_host=sum(e["name"] == "MemcpyD2H" for e in dev) / n)


def _compile_setting(setting, params, config, live: int, smoke: bool, info: dict, rng):
    """A setting's Decoder holding its slots' prompts, its `generate` compiled and run once:
    (decoder, state, row)."""
    import jax

    from benchmarks.gpu.on_gpu_admit import capacity_for, resolved_attention, served_decoder
    from decode.compile.aot import step_floor
    from decode.engine.step.state import Request
    name, method, window, refill, slots, page_size, attention = setting[:7]
    extra = dict(setting[7]) if len(setting) > 7 else {}
    options = extra.pop("compiler_options", None)
    row = dict(setting=name, method=method, window=window, refill=refill, slots=slots, live=live,
               **extra)
    t0 = time.perf_counter()
    dec = served_decoder(params, config, method=method, window=window, refill=refill, slots=slots,
                         capacity=capacity_for(live, smoke), page_size=page_size,
                         attention=attention, **extra)
    if options:   # `generate` compiled here with the options (the weights' layouts the compiler's)
        dec.use_compiler_layouts(None if smoke else options)
        row["compiler_options"] = options
    reqs = [Request(prompt=tuple(int(x) for x in rng.integers(0, config.vocab_size - 1, live)),
                    max_new_tokens=dec.capacity - live - 40, tau=0.4) for _ in range(slots)]
    st, _ = dec.generate(dec.start(reqs))
    jax.block_until_ready(st)
    row.update(compile_s=round(time.perf_counter() - t0, 1), capacity=dec.capacity,
               page_size=dec.static.page_size, attention=resolved_attention(dec))
    floor = step_floor(dec.static, live)
    row["floor_bytes"] = floor["total"]
    row["floor_ms"] = 1e3 * floor["total"] / info.get("hbm_bytes_per_s", 1.0)
    return dec, st, row


def _step_time_left(n: int, rounds: int, trace: bool) -> float:
    """Seconds the rounds (and traces) of `n` compiled settings take on a card, about."""
    return n * rounds * ROUND_CALL_S + (TRACE_S * min(n, MAX_TRACES) if trace else 0.0)


def _summarise(decs) -> None:
    ar = {}
    for dec, _, row, ms in decs:
        row["ms_per_step"] = statistics.median(ms)
        row["ms_rounds"] = [round(x, 3) for x in ms]
        row["floor_over_step"] = row["floor_ms"] / row["ms_per_step"]
        if row["method"] == "ar":
            ar[(row["slots"], row.get("page_size"))] = row["ms_per_step"]
    for dec, _, row, ms in decs:
        base = ar.get((row["slots"], row.get("page_size")))
        if base and row["method"] != "ar":
            row["step_over_ar"] = row["ms_per_step"] / base


def steps(smoke: bool, clock: Clock, rounds: int, info: dict, out: list, save=lambda: None,
          settings=None, live=None, trace_dir=None, reserve_s: float = 0.0) -> list[dict]:
    """The served decode step over random 8B-shaped bf16 weights, every setting interleaved;
    rows appended to `out` as they are made (a run cut short keeps the compiled settings). A
    setting is compiled only while the budget, less `reserve_s` (the later parts'), holds its
    compile and every compiled setting's rounds."""
    import jax

    from benchmarks.shapes import DECODE_SHAPES, SMOKE_SHAPE, device_params, model_config
    from wedlm_jax.model import unstack_layers
    config = model_config(dict(SMOKE_SHAPE if smoke else DECODE_SHAPES["8b"]))
    live = live or (32 if smoke else 2048)
    params = device_params(config)
    if jax.default_backend() == "gpu":
        params = unstack_layers(params, config.num_layers)
    rng = np.random.default_rng(1)
    decs = []
    for setting in STEP_SETTINGS:
        name = setting[0]
        if settings and name not in settings:
            continue
        need = SETTING_S + _step_time_left(len(decs) + 1, rounds, trace_dir is not None)
        if clock.left() - reserve_s < need:
            out.append(dict(setting=name, skipped="time budget"))
            continue
        try:
            dec, st, row = _compile_setting(setting, params, config, live, smoke, info, rng)
            decs.append([dec, st, row, []])
        except Exception as e:
            row = dict(setting=name, failed=error_line(e))
        out.append(row)
        save()
    for _ in range(rounds):
        for entry in decs:
            dec, st, row, ms = entry
            t0 = time.perf_counter()
            st, res = dec.generate(st)
            jax.block_until_ready(st)
            ms.append((time.perf_counter() - t0) * 1e3 / max(res.steps, 1))
            entry[1] = st
    for i, entry in enumerate(decs[:MAX_TRACES] if trace_dir else []):
        try:
            entry[1] = _trace(entry[0], entry[1], trace_dir, f"trace_{i}.json.gz")
            entry[2]["trace"] = f"trace_{i}.json.gz"
            entry[2]["trace_per_step"] = trace_summary(os.path.join(trace_dir, f"trace_{i}.json.gz"),
                                                       entry[0].steps_per_call)
        except Exception as e:
            entry[2]["trace_failed"] = error_line(e)
    _summarise(decs)
    return out


def train(smoke: bool, info: dict, attention: str = "auto,tiled") -> list[dict]:
    """The project's train step (the ~1B shape at 4096 tokens, one row, dual stream, bf16
    compute, remat; benchmarks.compiled.accelerator.run_train) with `attention`: names, comma-separated,
    "auto" the resolver's choice for the training structure here (on GPU the flash kernels,
    `attention.flash`; the default adds the pure-JAX tiled path beside them), "all" every one it
    offers. MFU against the probes' matmul rate, else the card's nominal peak."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from benchmarks.compiled.accelerator import make_plan, run_train
    from benchmarks.probes import device_info
    from benchmarks.gpu.on_gpu_admit import card_rate
    from wedlm_jax.attention import backends as ab
    info = info if "memory_bytes" in info else dict(device_info(), **info)
    rate, rate_from = card_rate(info)
    names = None if attention == "all" else list(dict.fromkeys(
        ab.resolve(a, "structure", backend=jax.default_backend(), dtype=jnp.bfloat16)
        for a in attention.split(",")))
    plan = make_plan("cpu" if smoke else "gpu", info["memory_bytes"], smoke=smoke)
    if not smoke:
        plan = dataclasses.replace(plan, train_lengths=(4096,), repeats=6)
    rows = run_train(plan, info, rate or float("nan"), attention=names)
    for r in rows:
        r["mfu_against"] = rate_from
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.on_gpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for on_gpu.json (created)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                    help=f"comma list of {', '.join(PARTS)} (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--settings", default="", help="steps: only these settings (comma list of "
                    "their names: " + "; ".join(x[0] for x in STEP_SETTINGS) + ")")
    ap.add_argument("--live", type=int, default=None, help="steps, admit: committed rows per slot")
    ap.add_argument("--train-attention", default="auto,tiled",
                    help="train: attention names, comma list; auto (the resolver's), all "
                         "(default: auto,tiled)")
    ap.add_argument("--torch-compile", default=None, help="torch_baseline: torch.compile mode "
                    "(default reduce-overhead; --smoke: none, eager)")
    ap.add_argument("--pages-per-tile", type=int, default=None,
                    help="steps, a probe: the paged gather path's pages per tile (default 4)")
    ap.add_argument("--trace", action="store_true",
                    help=f"steps: one generate call of each of the first {MAX_TRACES} settings "
                         "under jax's profiler, traces written to OUT/trace_<i>.json.gz")
    return ap


def _refusal(a, parts: list, settings: list) -> str | None:
    """Why the arguments cannot run (before any work), or None."""
    bad = [p for p in parts if p not in PARTS]
    if bad:
        return f"unknown part(s) {bad}; choose from {', '.join(PARTS)}"
    if "torch_baseline" in parts and set(parts[:parts.index("torch_baseline")]) & set(JAX_PARTS):
        return ("torch_baseline runs before the JAX parts (JAX holds the card's memory from its "
                "first part on); put it first")
    unknown = [x for x in settings if x not in [t[0] for t in STEP_SETTINGS]]
    if unknown:
        return f"unknown setting(s) {unknown}"
    if not a.smoke and not nvidia_smi():
        import jax                             # no NVIDIA GPU named: does jax see another?
        if jax.default_backend() != "gpu":
            return f"needs a GPU (jax sees {jax.default_backend()}); --smoke runs it on CPU"
    return None


def run_part(part: str, a, clock: Clock, report: dict, save, later: list) -> object:
    """One part's result (`later`: the parts after it, whose least time is kept for them)."""
    reserve = 0.0 if a.smoke else sum(PART_S[p] for p in later)
    info = report.get("probes") or {}
    if part in ("torch_baseline", "qmatmul", "admit", "train") and clock.left() - reserve < PART_S[part]:
        return {"skipped": "time budget"}
    if part == "torch_baseline":
        from benchmarks.gpu.torch_baseline import run_subprocess
        return run_subprocess(os.path.join(a.out, "torch_baseline.json"),
                              min(TORCH_MAX_S, clock.left() - reserve), a.smoke,
                              live=a.live, steps=8 if a.smoke else 32, rounds=2 if a.smoke else 5,
                              mode=a.torch_compile)
    import jax
    if not a.smoke and jax.default_backend() != "gpu":
        raise RuntimeError(f"jax sees {jax.default_backend()}, not the GPU")
    if part == "probes":
        return probes(a.smoke)
    if part == "kernel":
        return kernel(a.smoke)
    if part == "kernel_time":
        return kernel_time(a.smoke, clock, info)
    if part == "qmatmul":
        return qmatmul(a.smoke, info)
    if part == "tokens":
        return tokens(a.smoke)
    if part == "admit":
        from benchmarks.gpu.on_gpu_admit import admit
        return admit(a.smoke, min(a.rounds, 5), info, a.live)
    if part == "train":
        return train(a.smoke, info, a.train_attention)
    report[part] = []
    return steps(a.smoke, clock, a.rounds, info, report[part], save, a.settings_list, a.live,
                 a.out if a.trace else None, reserve)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    a.settings_list = [x.strip() for x in a.settings.split(",") if x.strip()]
    why = _refusal(a, parts, a.settings_list)
    if why:
        print(f"on_gpu: {why}", file=sys.stderr)
        return 2
    if a.pages_per_tile:
        _pages_per_tile(a.pages_per_tile)
    os.makedirs(a.out, exist_ok=True)
    clock, report = Clock(a.budget_s), {"argv": sys.argv[1:] if argv is None else list(argv)}
    report["card"] = card_info(a.smoke)
    path = os.path.join(a.out, "on_gpu.json")

    def save():
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    save()
    for i, part in enumerate(parts):
        t0 = time.perf_counter()
        try:
            report[part] = run_part(part, a, clock, report, save, parts[i + 1:])
        except Exception as e:
            report[part] = {"failed": error_line(e), "traceback": traceback.format_exc()[-3000:]}
        report.setdefault("seconds", {})[part] = round(time.perf_counter() - t0, 1)
        save()
        print(f"[{part} done in {report['seconds'][part]} s, {clock.left():.0f} s left]", flush=True)
    report["targets"] = targets(report, a.smoke)
    save()
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
