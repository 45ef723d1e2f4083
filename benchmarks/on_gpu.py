"""What only a GPU can tell, in one short run on a lent card (a session's 15 device minutes).

    python -m benchmarks.on_gpu --out DIR [--budget-s 420] [--parts kernel,tokens,steps]
    python -m benchmarks.on_gpu --smoke --out DIR        # this CPU: tiny shapes, the same paths

On a lent card (the machine's own jax: `PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=.92 python3
-m benchmarks.on_gpu --out $OUT ...`): the whole run took 455 s on an H100 (kernel 161 s, tokens
127 s, each decode setting ~25 s of compile). The next card: `--parts
probes,tokens,kernel_time,steps,train --trace --budget-s 480` (tokens again: the paged cache's
Triton kernel is new since the first run, 2026-11-26), the kernels' and steps' times, a profiler
trace of the first settings.

Parts, in this order, each skipped when the run's time budget is spent (what ran is written to
DIR/on_gpu.json after every part, so a run cut short keeps its figures):
  probes   the card's HBM bandwidth (x + 1 over 4 GiB: bytes read + written) and bf16 matmul rate
           (8192^3), measured here: the roofline the step times are read against.
  kernel   every cache-attention backend the platform offers (Triton kernel, cuDNN, tiled XLA)
           and the paged gather path against the dense reference in float32 at HIGHEST
           precision, on random K/V and ragged cache lengths, at the 8B model's head layout for
           1, 16 and 32 query slots: relative error, NaN never.
  kernel_time  each Triton kernel (dense cache in place; paged) at 1, 4 and 16 splits of the
           live rows and the paged gather path, alone: microseconds per layer and the live K/V
           GB/s at batch 1 and 8, 2K and 16K live rows, 1 and 16 query slots (KERNEL_POINTS).
  tokens   the demo model decoded greedy on this GPU by the Decoder with each cache layout and
           backend (dense tiled / dense Triton / paged 64), against the same Decoder on this
           machine's CPU: sequences equal, first difference.
  steps    the decode step as served: a Decoder over random bf16 weights of the Qwen3-8B shape
           (the GPU's own layout: one tree per layer, paged cache of 64 by default), 8 slots of
           capacity 4096 each holding a distinct 2048-token prompt, AR and streaming / verified
           windows; each setting compiled, then timed in interleaved rounds (one `generate` call
           of 8 steps per setting per round), medians: ms per step, step / AR, and the step's
           floor (weights + live K/V + logits) over the measured bandwidth.
  train    the train step of the ~1B shape at 4096 tokens with each attention backend offered
           (benchmarks.accelerator.run_train): step time, tokens/s, MFU against the measured rate.
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

PARTS = ("probes", "kernel", "kernel_time", "tokens", "steps", "train")
# (name, method, window, refill, slots, page_size, attention): the served default (page_size
# None: the platform's choice, the dense cache and the Triton kernel on GPU) first
STEP_SETTINGS = (
    ("ar b8", "ar", 1, "after", 8, None, "auto"),
    ("streaming W16 after b8", "streaming", 16, "after", 8, None, "auto"),
    ("streaming W8 after b8", "streaming", 8, "after", 8, None, "auto"),
    ("streaming W16 before b8", "streaming", 16, "before", 8, None, "auto"),
    ("ar b8 paged", "ar", 1, "after", 8, 64, "auto"),
    ("streaming W16 after b8 paged", "streaming", 16, "after", 8, 64, "auto"),
    ("ar b8 paged gather", "ar", 1, "after", 8, 64, "tiled"),
    ("ar b1", "ar", 1, "after", 1, None, "auto"),
    ("streaming W16 after b1", "streaming", 16, "after", 1, None, "auto"),
    ("verified W16 after b8", "verified", 16, "after", 8, None, "auto"),
)


MAX_TRACES = 4       # a lent machine returns at most 8 files


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def _err(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}"


def probes(smoke: bool) -> dict:
    from benchmarks.accelerator import device_info, probe_bandwidth, probe_matmul
    info = device_info()
    bw = probe_bandwidth((4 << 20) if smoke else (4 << 30), 10)
    mm = probe_matmul(128 if smoke else 8192, 10)
    return dict(info, hbm_bytes_per_s=bw, bf16_flops=mm)


def kernel(smoke: bool) -> list[dict]:
    """Each cache-attention backend and the paged gather path against the dense reference."""
    import jax
    import jax.numpy as jnp

    from wedlm_jax import attention_backends as ab
    from wedlm_jax import cache_attention as ca
    from wedlm_jax import paged_attention as pa
    b, h, kvh, d, t = (2, 4, 2, 16, 96) if smoke else (8, 32, 8, 128, 4160)
    interpret = smoke
    out = []
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        impls = ab.available("cache", backend=jax.default_backend(), dtype=dtype,
                             interpret=interpret)
        for s in (1, 16, 32):
            q = jnp.asarray(rng.standard_normal((b, s, h, d)), dtype)
            k = jnp.asarray(rng.standard_normal((b, t, kvh, d)), dtype)
            v = jnp.asarray(rng.standard_normal((b, t, kvh, d)), dtype)
            lens = jnp.asarray(rng.integers(0, t - s + 1, size=b), jnp.int32)
            scale = d ** -0.5
            with jax.default_matmul_precision("highest"):
                ref = np.asarray(ca.attend_cache_dense(q.astype(jnp.float32), k.astype(jnp.float32),
                                                       v.astype(jnp.float32), lens, scale), np.float64)
            runs = {impl: (lambda impl=impl: ca.attend_cache(
                impl, q, k, v, lens, scale,
                tile=ca.pallas_tile(256, s * (h // kvh), d, jnp.dtype(dtype).itemsize,
                                    ca.smem_limit(jax.devices()[0])) if impl == "pallas" else 256,
                interpret=interpret)) for impl in impls if impl != "dense"}
            page = 64 if not smoke else 16
            pages = t // page          # t is a multiple of the page

            def paged(page=page, pages=pages):
                pool = pa.interleave(k, v).reshape(b * pages, page, 2 * kvh, d)
                table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
                return pa.attend_pages("gather", q, pool, table, lens, scale)
            runs["paged gather"] = paged
            for name, fn in runs.items():
                row = dict(dtype=jnp.dtype(dtype).name, slots=s, backend=name)
                try:
                    got = np.asarray(jax.jit(fn)(), np.float64)
                    row["rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    row["nan"] = bool(np.isnan(got).any())
                except Exception as e:                  # one backend failing keeps the others
                    row["failed"] = _err(e)
                out.append(row)
    return out


# (batch, live rows, query slots): a long context at batch 1, the served batch at 2K, windows
KERNEL_POINTS = ((1, 16384, 1), (1, 16384, 16), (1, 2048, 16), (8, 2048, 1), (8, 2048, 16))
KERNEL_SPLITS = (1, 4, 16)


def kernel_time(smoke: bool, clock: Clock, info: dict) -> list[dict]:
    """Each cache-attention kernel alone, as a step runs it: `layers` layers' calls (a static
    layer each) in one jitted program over the stacked cache or the pool, bf16, the 8B heads (32
    query / 8 KV, head_dim 128): the Triton kernel on the dense cache and the Triton paged kernel
    at each of KERNEL_SPLITS, and the paged gather path; median ms per layer and the live K/V
    bytes a layer reads over it (GB/s, against the card's copy rate)."""
    import jax
    import jax.numpy as jnp

    from wedlm_jax import cache_attention as ca
    from wedlm_jax import paged_attention as pa
    layers, h, kvh, d, page = (2, 4, 2, 16, 16) if smoke else (8, 32, 8, 128, 64)
    points = ((1, 64, 1), (2, 32, 4)) if smoke else KERNEL_POINTS
    out = []
    for b, live, s in points:
        cap = -(-(live + s) // page) * page
        pages = cap // page
        rng = jax.random.split(jax.random.key(b * live + s), 3)
        q = jax.random.normal(rng[0], (b, s, h, d), jnp.bfloat16)
        lens = jnp.full((b,), live, jnp.int32)
        kv_bytes = b * (live + s) * kvh * d * 2 * 2
        table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        variants = [(f"dense pallas, {n} split{'s' * (n > 1)}", "dense", n) for n in KERNEL_SPLITS]
        variants += [(f"paged triton, {n} split{'s' * (n > 1)}", "triton", n) for n in KERNEL_SPLITS]
        variants.append(("paged gather, 16 pages a tile", "gather", 1))
        k = jax.random.normal(rng[1], (layers, b, cap, kvh, d), jnp.bfloat16)
        v = jax.random.normal(rng[2], (layers, b, cap, kvh, d), jnp.bfloat16)
        pool = pa.interleave(k, v).reshape(layers * b * pages, page, 2 * kvh, d)
        for name, kind, n in variants:
            if clock.left() < 30:
                out.append(dict(batch=b, live=live, slots=s, kernel=name, skipped="time budget"))
                continue
            row = dict(batch=b, live=live, slots=s, kernel=name)

            def one(q, k, v, pool, kind=kind, n=n):
                acc = jnp.zeros(q.shape, jnp.float32)
                for layer in range(layers):
                    if kind == "dense":
                        o = ca.attend_cache_pallas(q, k, v, lens, 0.1, 64, layer=layer, splits=n,
                                                   interpret=smoke)
                    elif kind == "triton":
                        o = pa.attend_pages_triton(q, pool, table, lens, 0.1,
                                                   first_page=layer * b * pages, splits=n,
                                                   interpret=smoke)
                    else:
                        o = pa.attend_pages_gather(q, pool, table, lens, 0.1,
                                                   1024 // page, first_page=layer * b * pages)
                    acc = acc + o.astype(jnp.float32)
                return acc
            try:
                fn = jax.jit(one)
                jax.block_until_ready(fn(q, k, v, pool))
                times = []
                for _ in range(3 if smoke else 15):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v, pool))
                    times.append((time.perf_counter() - t0) / layers)
                t = statistics.median(times)
                row.update(ms_per_layer=t * 1e3, gb_per_s=kv_bytes / t / 1e9,
                           of_copy_rate=kv_bytes / t / info.get("hbm_bytes_per_s", float("inf")))
            except Exception as e:
                row["failed"] = _err(e)
            out.append(row)
        del k, v, pool
    return out


def tokens(smoke: bool) -> list[dict]:
    """The demo model's greedy tokens by each Decoder layout on this GPU against its CPU run."""
    import jax
    import jax.numpy as jnp

    from decode.config import DecodeConfig
    from decode.decoder import Decoder
    from decode.static_batch import generate
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
                dec = Decoder(p, config, method=method, window=window, slots=8, capacity=cap,
                              steps_per_call=8, sampling=False, page_size=page_size,
                              attention=attention, dtype=jnp.float32)
                return generate(p, config, prompts, dc, decoder=dec).tokens
        try:
            want = run(cpu, 0, "tiled")
        except Exception as e:
            out.append(dict(method=method, layout="cpu reference", failed=_err(e)))
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
                row["failed"] = _err(e)
            out.append(row)
    return out


def _pages_per_tile(n: int) -> None:
    """A probe, not a setting: the paged gather path with `n` pages per tile of its loop."""
    from wedlm_jax import paged_attention as pa
    gather = pa.attend_pages_gather

    def patched(q, pool, table, cache_len, scale, pages_per_tile=4, first_page=0):
        return gather(q, pool, table, cache_len, scale, n, first_page)
    pa.attend_pages_gather = patched


def _trace(dec, st, folder: str, name: str):
    """One `generate` call under jax's profiler; its trace.json.gz copied to folder/name (the
    profiler's own folder is nested too deep to come back from a lent machine)."""
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


def steps(smoke: bool, clock: Clock, rounds: int, info: dict, out: list, save=lambda: None,
          settings=None, live=None, trace_dir=None) -> list[dict]:
    """The served decode step over random 8B-shaped bf16 weights, every setting interleaved;
    rows appended to `out` as they are made (a run cut short keeps the compiled settings)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.accelerator import DECODE_SHAPES, SMOKE_SHAPE, device_params, model_config
    from decode.aot import step_floor
    from decode.decoder import Decoder, Request
    from wedlm_jax import attention_backends as ab
    from wedlm_jax import paged_attention as pa
    from wedlm_jax.model import unstack_layers
    config = model_config(dict(SMOKE_SHAPE if smoke else DECODE_SHAPES["8b"]))
    capacity, default_live = (128, 32) if smoke else (4096, 2048)
    live = live or default_live
    params = device_params(config)
    if jax.default_backend() == "gpu":
        params = unstack_layers(params, config.num_layers)
    rng = np.random.default_rng(1)
    decs = []
    for name, method, window, refill, slots, page_size, attention in STEP_SETTINGS:
        if settings and name not in settings:
            continue
        if clock.left() < 60:
            out.append(dict(setting=name, skipped="time budget"))
            continue
        row = dict(setting=name, method=method, window=window, refill=refill, slots=slots, live=live)
        t0 = time.perf_counter()
        try:
            dec = Decoder(params, config, method=method, window=window, refill=refill, slots=slots,
                          capacity=capacity, steps_per_call=8, dtype=jnp.bfloat16, sampling=False,
                          mask_token_id=config.vocab_size - 1, page_size=page_size,
                          attention=attention, allow_long=True)
            reqs = [Request(prompt=tuple(int(x) for x in rng.integers(0, config.vocab_size - 1, live)),
                            max_new_tokens=capacity - live - 40, tau=0.4) for _ in range(slots)]
            st = dec.start(reqs)
            st, _ = dec.generate(st)
            jax.block_until_ready(st)
            paged_impl = pa.implementation_for(jax.default_backend(), dec.static.attention)
            row.update(compile_s=round(time.perf_counter() - t0, 1), page_size=dec.static.page_size,
                       attention=(paged_impl if dec.static.page_size else ab.resolve(
                           attention, "cache", backend=jax.default_backend(), dtype=jnp.bfloat16)))
            floor = step_floor(dec.static, live)
            row["floor_bytes"] = floor["total"]
            row["floor_ms"] = 1e3 * floor["total"] / info.get("hbm_bytes_per_s", 1.0)
            decs.append([dec, st, row, []])
        except Exception as e:
            row["failed"] = _err(e)
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
            entry[2]["trace_failed"] = _err(e)
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
    return out


def train(smoke: bool, info: dict) -> list[dict]:
    """The project's train step (the ~1B shape at 4096 tokens, one row, bf16 compute, remat)
    with every attention backend the resolver offers here (benchmarks.accelerator.run_train)."""
    import dataclasses

    from benchmarks.accelerator import make_plan, run_train
    plan = make_plan("cpu" if smoke else "gpu", info["memory_bytes"], smoke=smoke)
    if not smoke:
        plan = dataclasses.replace(plan, train_lengths=(4096,), repeats=6)
    return run_train(plan, info, info["bf16_flops"])


def table(report: dict) -> str:
    lines = []
    p = report.get("probes") or {}
    if "device_kind" in p:
        lines.append(f"{p['device_kind']}, jax {p['jax']}: copy {p['hbm_bytes_per_s'] / 1e12:.2f} "
                     f"TB/s, bf16 matmul {p['bf16_flops'] / 1e12:.0f} TFLOP/s")
    for r in report.get("kernel") or []:
        lines.append(f"kernel {r['dtype']:>8} S={r['slots']:<3} {r['backend']:<13} "
                     + (f"rel err {r['rel_err']:.2e} nan {r['nan']}" if "rel_err" in r else r.get("failed", "")))
    for r in report.get("kernel_time") or []:
        lines.append(f"kernel time b={r['batch']} live={r['live']} S={r['slots']:<3} {r['kernel']:<30} "
                     + (f"{r['ms_per_layer'] * 1e3:8.1f} us/layer {r['gb_per_s']:7.0f} GB/s"
                        if "ms_per_layer" in r else r.get("failed") or r.get("skipped", "")))
    for r in report.get("tokens") or []:
        lines.append(f"tokens {r['method']:<10} {r['layout']:<13} "
                     + (f"{r['equal']}/{r['of']} equal, first differences {r['first_difference']}"
                        if "equal" in r else r.get("failed", "")))
    for r in report.get("steps") or []:
        if "ms_per_step" in r:
            lines.append(f"step {r['setting']:<30} {r['ms_per_step']:8.3f} ms  floor {r['floor_ms']:.3f} ms "
                         f"({100 * r['floor_over_step']:.0f}%)  / AR {r.get('step_over_ar', 1.0):.3f}  "
                         f"[{r.get('attention')}, page {r.get('page_size')}, compile {r['compile_s']} s]")
        else:
            lines.append(f"step {r['setting']:<30} {r.get('failed') or r.get('skipped')}")
    for r in report.get("train") or []:
        if isinstance(r, dict) and "step_s" in r:
            lines.append(f"train {r['attention']:<8} L={r['seq_len']} {r['step_s'] * 1e3:.1f} ms "
                         f"{r['tokens_per_s']:.0f} tokens/s MFU {100 * r['mfu_probe']:.1f}% of the "
                         f"measured matmul rate")
        elif isinstance(r, dict):
            lines.append(f"train {r}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.on_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for on_gpu.json (created)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--settings", default="", help="steps: only these settings (comma list of "
                    "their names: " + "; ".join(x[0] for x in STEP_SETTINGS) + ")")
    ap.add_argument("--live", type=int, default=None, help="steps: committed rows per slot")
    ap.add_argument("--pages-per-tile", type=int, default=None,
                    help="steps, a probe: the paged gather path's pages per tile (default 4)")
    ap.add_argument("--trace", action="store_true",
                    help=f"steps: one generate call of each of the first {MAX_TRACES} settings "
                         "under jax's profiler, traces written to OUT/trace_<i>.json.gz")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"on_gpu: unknown part(s) {bad}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    import jax
    if jax.default_backend() != "gpu" and not a.smoke:
        print(f"on_gpu: needs a GPU (jax sees {jax.default_backend()}); --smoke runs it on CPU",
              file=sys.stderr)
        return 2
    settings = [x.strip() for x in a.settings.split(",") if x.strip()]
    unknown = [x for x in settings if x not in [t[0] for t in STEP_SETTINGS]]
    if unknown:
        print(f"on_gpu: unknown setting(s) {unknown}", file=sys.stderr)
        return 2
    if a.pages_per_tile:
        _pages_per_tile(a.pages_per_tile)
    os.makedirs(a.out, exist_ok=True)
    clock, report = Clock(a.budget_s), {"argv": sys.argv[1:]}
    path = os.path.join(a.out, "on_gpu.json")

    def save():
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    for part in parts:
        t0 = time.perf_counter()
        try:
            if part == "probes":
                report[part] = probes(a.smoke)
            elif part == "kernel":
                report[part] = kernel(a.smoke)
            elif part == "kernel_time":
                report[part] = kernel_time(a.smoke, clock, report.get("probes") or {})
            elif part == "tokens":
                report[part] = tokens(a.smoke)
            elif part == "train":
                if clock.left() < 120:
                    report[part] = {"skipped": "time budget"}
                else:
                    report[part] = train(a.smoke, report["probes"])
            else:
                report[part] = []
                steps(a.smoke, clock, a.rounds, report.get("probes") or {}, report[part], save,
                      settings, a.live, a.out if a.trace else None)
        except Exception as e:
            report[part] = {"failed": _err(e), "traceback": traceback.format_exc()[-3000:]}
        report.setdefault("seconds", {})[part] = round(time.perf_counter() - t0, 1)
        save()
        print(f"[{part} done in {report['seconds'][part]} s, {clock.left():.0f} s left]", flush=True)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
