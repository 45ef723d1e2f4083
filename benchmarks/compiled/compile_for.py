"""The accelerator picture without the accelerator: the project's programs compiled by the
target's own compiler on this machine, side by side in one report.

    python -m benchmarks.compiled.compile_for --compile-for v5p:1x1x1,v5e:2x4,v6e:2x4,v5p:2x2x2
                                     [--model 8b|7b|4b|1.7b|0.6b] [--quick] [--out DIR]
                                     [--tokens-per-forward 2.0] [--page-size 64]
                                     [--programs decode,prefill,train] [--train-model 1b|8b]
                                     [--quantize int8|int4 [--quantize-group N]]

Per target (a TPU topology libtpu describes; no TPU needed) and at the chosen decode shape in
bf16, with the slots over data and the heads over `tensor` = all chips of the topology:
  decode    `generate` of one step (decode/compile/aot.py): AR and streaming W 16 (refill before) at
            batch 1 / 8 / 64; streaming W 8 / 32 before and W 8 / 16 / 32 after, and verified W 16,
            at batch 8 (--quick: AR and streaming W 16 before at batch 8); capacity 4096 with 2048
            live rows per slot
  prefill   one 2048-token prompt in one chunk
  train     the train step of configs/wedlm_8b_from_qwen3.yaml's objective (dual stream, block 32,
            4096-token rows, remat full, bf16, loss in 1024-slot chunks; its cost from unchunked
            compiles, see `train_row`) for the 1B-class shape
            (benchmarks.shapes.TRAIN_SHAPE), fsdp over all chips, one row per chip, with the
            attention resolved for the target (splash on TPU)
with --quantize, the decode programs' projections quantized (wedlm_jax.quantize: their bytes and
the floor's weights as stored);
with --page-size, every decode program also with the paged cache (one chip; jax's ragged paged
attention kernel on TPU: libtpu counts ~10 KB for the Mosaic call, so every layer's live K/V
pages, queries and output are added analytically, `benchmarks.compiled.step_bytes.kernel_not_counted`),
and reports per program: memory per device from the full-depth compile (fits or not in the chip's
HBM, the compiler's own out-of-memory verdict included), flops / bytes accessed / libtpu's
optimal_seconds of the whole depth (`decode.compile.aot.unrolled_cost`: the layer scan unrolled, since
cost_analysis counts a loop body once; the live K/V tiles past the first, read in a loop of runtime
trip count, added analytically), the analytic floor (decode), the roofline step time max(flops / peak,
bytes / bandwidth), the streaming / AR step ratio at equal batch, estimated decode tokens/s (AR:
batch / step; streaming: batch x --tokens-per-forward / step, an assumption stated in the report)
and the train step's MFU estimates (`train_mfu`: model FLOPs over libtpu's optimal_seconds of the
program compiled to be costed, SparseCore offload off, plus the attention kernel at peak; and the
roofline's upper bound where it is one).

Writes DIR/compile_for.json and DIR/compile_for.md (DIR default benchmarks/results/compile_for);
refuses a DIR holding files it did not write.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from benchmarks.compiled.compile_for_report import markdown, plot
from benchmarks.compiled.step_bytes import grouped_kernel_bytes, hbm_traffic, kernel_not_counted
from wedlm_jax.runtime.targets import FORMS, GIB, TargetError, describe_target


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    devices: tuple
    peak_flops: float
    bandwidth: float
    hbm: int

    @property
    def chips(self) -> int:
        return len(self.devices)


def describe(name: str) -> Target:
    """The compile-only devices of a target name and its chip's figures (wedlm_jax.runtime.targets); a
    TargetError naming the accepted forms (and the install command when its compiler is missing)."""
    try:
        devices, chip = describe_target(name)
    except TargetError as e:
        raise TargetError(f"--compile-for {e}") from None
    return Target(name, tuple(devices), chip.flops, chip.bandwidth, chip.hbm)


def _verdict_or_raise(fn, *a, **kw) -> dict:
    """fn(*a, **kw), or {'oom': the compiler's reason} when it refuses for want of memory."""
    from wedlm_jax.runtime.failures import out_of_memory
    try:
        return fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - only an out-of-memory compile is a verdict
        reason = out_of_memory(e)
        if reason is None:
            raise
        return {"oom": reason}


def roofline(cost: dict, t: Target) -> float | None:
    if not cost or "flops" not in cost or "bytes accessed" not in cost:
        return None
    return max(cost["flops"] / t.peak_flops, cost["bytes accessed"] / t.bandwidth)


def decode_programs(quick: bool) -> list[dict]:
    if quick:
        return [dict(method="ar", window=1, refill="before", slots=8),
                dict(method="streaming", window=16, refill="before", slots=8)]
    out = []
    for slots in (1, 8, 64):
        out += [dict(method="ar", window=1, refill="before", slots=slots),
                dict(method="streaming", window=16, refill="before", slots=slots)]
    out += [dict(method="streaming", window=w, refill="before", slots=8) for w in (8, 32)]
    out += [dict(method="streaming", window=w, refill="after", slots=8) for w in (8, 16, 32)]
    out.append(dict(method="verified", window=16, refill="after", slots=8))
    return out


def decode_row(config, t: Target, prog: dict, capacity: int, live: int,
               page_size: int | None = None, quantize: str = "none",
               quantize_group: int | None = None, lora=None) -> dict:
    """One decode program's figures: the dense cache (slots over nothing, heads over all chips)
    or, with `page_size`, the paged cache on one chip (its attention resolved for the target:
    jax's ragged paged attention kernel on TPU). `lora`: LoraOptions (the adapter table among the
    weights, every slot's row gathered)."""
    from decode.compile import aot
    from decode.config import EngineOptions, Placement
    tensor = t.chips if config.num_kv_heads % t.chips == 0 and not page_size else 1
    mesh = (1, 1, tensor) if t.chips > 1 and tensor > 1 else None
    from wedlm_jax.attention import backends as attention_backends
    platform = t.devices[0].platform
    attention = "tiled" if platform == "tpu" else "auto"     # GPU: the Pallas (Triton) kernel
    engine = EngineOptions(**prog, capacity=capacity)
    placement = Placement(dtype="bfloat16", attention=attention, kv_tile=256,
                          mesh=mesh or (1, 1, 1), page_size=page_size or 0, quantize=quantize,
                          quantize_group=quantize_group)
    devices = list(t.devices[:tensor]) if mesh else [t.devices[0]]
    full = _verdict_or_raise(aot.compile_generate, config, devices, engine, placement,
                             live_rows=live, lora=lora)
    row = dict(prog, kind="decode", chips_used=len(devices), capacity=capacity, live_rows=live,
               quantize=quantize, quantize_group=quantize_group,
               lora_rows=lora.rows if lora else 0, lora_rank=lora.rank if lora else 0,
               cache=f"paged {page_size}" if page_size else "dense",
               attention=attention_backends.resolve(attention, "cache", backend=platform,
                                                    dtype="bfloat16"))
    if "oom" in full:
        return dict(row, fits=False, oom=full["oom"])
    cost = (hlo_cost(config, devices, engine, placement, live, lora) if platform == "gpu"
            else libtpu_cost(config, devices, engine, placement, live, row["attention"], lora))
    step = roofline(cost, t)
    floor = full["floor"]["total"]
    return dict(row, memory=full["memory"], fits=full["memory"]["total"] <= t.hbm, cost=cost,
                floor_bytes=floor, weight_layout=full.get("weight_layout"),
                compiler_options=full.get("compiler_options"),
                bytes_over_floor=cost["bytes accessed"] / floor if cost else None,
                floor_s=floor / t.bandwidth, roofline_s=step)


def libtpu_cost(config, devices, engine, placement, live: int, attention: str,
                lora=None) -> dict:
    """A decode step's cost from libtpu's cost analysis of the whole-depth program, plus what it
    does not count: the live K/V tiles past the first of the tiled XLA attention (a loop of
    runtime trip count), or the ragged kernel's pages, queries and output (a custom call), and
    the grouped matmul kernel's values, scales, inputs and outputs and its matmuls' flops
    (Mosaic calls)."""
    from decode.compile import aot
    cost = aot.unrolled_cost(aot.compile_generate, config, devices, engine, placement, lora=lora)
    if not cost:
        return cost
    span = 1 if engine.method == "ar" else (2 if engine.refill == "before" else 1) * engine.window
    if not placement.page_size and attention == "tiled":
        cost["kv_not_counted"] = aot.kv_not_counted(engine.slots, config, live,
                                                    placement.kv_tile, "bfloat16",
                                                    placement.mesh[2])
    else:
        cost["kv_not_counted"] = kernel_not_counted(engine.slots, span, config, live, "bfloat16")
    cost["bytes accessed"] += cost["kv_not_counted"]
    from wedlm_jax.quantize_scheme import resolve_group
    group = resolve_group(placement.quantize, placement.quantize_group)
    if group and len(devices) == 1:                 # read by the Mosaic grouped matmul kernel
        rows = engine.slots * span
        bits = 4 if placement.quantize == "int4" else 8
        cost["grouped_not_counted"] = grouped_kernel_bytes(config, rows, group, bits,
                                                           placement.dtype)
        cost["bytes accessed"] += cost["grouped_not_counted"]
        cost["grouped_flops_not_counted"] = grouped_kernel_bytes(config, rows, group, bits,
                                                                 placement.dtype, flops=True)
        cost["flops"] += cost["grouped_flops_not_counted"]
    return cost


def hlo_cost(config, devices, engine, placement, live: int = 2048, lora=None) -> dict:
    """A decode step's cost where the compiler gives none (XLA:GPU): the whole-depth program's
    HBM traffic estimated from its instructions (`benchmarks.compiled.step_bytes.hbm_traffic`: operands and
    results of every top-level instruction, in-place updates as their update) plus the attention
    kernels' live K/V, queries and output (`benchmarks.compiled.step_bytes.kernel_not_counted`: their
    custom calls name whole buffers); flops analytic (2 x weights x rows, the matmuls). {"from": "hlo", ...}."""
    from decode.compile import aot
    dec, compiled = aot.generate_program(config, devices, engine, placement,
                                         scan_unroll=config.num_layers, lora=lora)
    span = 1 if engine.method == "ar" else dec.static.span
    kernel = kernel_not_counted(engine.slots, span, config, live, placement.dtype)
    rows = engine.slots * span
    return {"bytes accessed": hbm_traffic(compiled.as_text()) + kernel, "kv_not_counted": kernel,
            "flops": 2.0 * config.num_params() * rows, "from": "hlo"}


def prefill_row(config, t: Target, prompt_len: int) -> dict:
    from decode.compile import aot
    tensor = t.chips if config.num_kv_heads % t.chips == 0 else 1
    mesh = (1, 1, tensor) if t.chips > 1 and tensor > 1 else None
    devices = list(t.devices[:tensor]) if mesh else [t.devices[0]]
    from decode.config import Placement
    placement = Placement(dtype="bfloat16", attention="tiled", page_size=0,
                          mesh=mesh or (1, 1, 1))
    kw = dict(prompt_len=prompt_len)
    full = _verdict_or_raise(aot.compile_prefill, config, devices, None, placement, **kw)
    row = dict(kind="prefill", prompt_len=prompt_len, chips_used=len(devices))
    if "oom" in full:
        return dict(row, fits=False, oom=full["oom"])
    cost = aot.unrolled_cost(aot.compile_prefill, config, devices, None, placement, **kw)
    step = roofline(cost, t)
    return dict(row, memory=full["memory"], fits=full["memory"]["total"] <= t.hbm, cost=cost,
                roofline_s=step, tokens_per_s=prompt_len / step if step else None)


def train_row(t: Target, seq_len: int = 4096, shape: dict | None = None,
              lora_rank: int = 0) -> dict:
    """The train step of `shape` (default benchmarks.shapes.TRAIN_SHAPE, the 1B class), one
    `seq_len` row per chip, fsdp over the chips: memory from the real (scanned, chunked-loss)
    program, cost and MFU estimates from the unrolled one compiled to be costed
    (`wedlm_jax.runtime.compiled.estimate_options`: no SparseCore offload, whose ops libtpu does not cost).
    `lora_rank` > 0: the LoRA step (adapters of that rank, alpha 2 x rank, on all seven
    projections; the base frozen in bf16), its MFU left out (its model FLOPs are not the full
    step's 6N a token)."""
    from benchmarks.shapes import TRAIN_SHAPE
    from train import dry_run, step as step_lib
    from train.config import config_from_dict
    from wedlm_jax.runtime.compiled import estimate_options, figures
    shape = dict(shape or TRAIN_SHAPE)
    block = 32
    cfg = config_from_dict({
        "model": {"config": shape},
        "data": {"train_files": ["unused.jsonl"], "seq_len": seq_len,
                 "global_batch_size": t.chips},
        "objective": {"kind": "dual_stream", "block_size": block, "ar_weight": 1.0},
        "mesh": {"data": 1, "fsdp": t.chips, "tensor": 1},
        "compute_dtype": "bf16", "remat": "full", "loss_chunk": 1024,
        **({"lora": {"rank": lora_rank, "alpha": 2.0 * lora_rank}} if lora_rank else {})},
        "the train shape")
    platform = t.devices[0].platform

    def compile_train(c, unroll=1, options=None):
        mc = dry_run.model_config_for(c)
        return figures(dry_run.compile_step(c, mc, list(t.devices), scan_unroll=unroll,
                                            compiler_options=options)[0])

    full = _verdict_or_raise(compile_train, cfg)
    mc = dry_run.model_config_for(cfg)
    attention = step_lib.attention_impl(cfg, backend=platform)
    row = dict(kind="train", seq_len=seq_len, rows_per_chip=1, attention=attention,
               params=mc.num_params(), lora_rank=lora_rank)
    if "oom" in full:
        return dict(row, fits=False, oom=full["oom"])
    # cost from the program with the layer scan unrolled and the loss unchunked (cost_analysis
    # counts a loop body once: a chunked loss is a scan too, it would count one chunk of the head)
    unrolled = dataclasses.replace(cfg, loss_chunk=0)
    cost = compile_train(unrolled, shape["num_layers"], estimate_options(platform)).get("cost") or {}
    model_flops = step_lib.model_flops_per_row(mc, seq_len, "dual_stream", block) * t.chips
    # the attention kernel (splash: a custom call; tiled: a loop of runtime trip count) is not in
    # the cost: its FLOPs per chip as executed (remat full: the forward twice, then the backward)
    kernel_flops = 0.0 if attention == "dense" else (
        step_lib.attention_flops_per_row(mc, seq_len, "dual_stream", block) * 4 / 3)
    times = train_mfu(model_flops, cost, t, kernel_flops)
    if lora_rank:
        times = {k: v for k, v in times.items() if not k.startswith("mfu")}
    return dict(row, memory=full["memory"], fits=full["memory"]["total"] <= t.hbm, cost=cost,
                kernels=full["kernels"], kernel_flops=kernel_flops, **times)


def train_mfu(model_flops: float, cost: dict, t: Target, kernel_flops: float = 0.0) -> dict:
    """The train step's time and MFU estimates, per chip, `model_flops` over all chips:
    `step_s` = libtpu's `optimal_seconds` (its own schedule of the costed program) plus the
    attention kernel's `kernel_flops` at the chip's peak (the cost does not see the kernel; at
    peak, so the MFU is optimistic by the kernel's shortfall), `mfu` = model FLOPs over that time;
    `roofline_s` = max((compiled + kernel) FLOPs / peak, bytes / bandwidth) and `mfu_bound` = model
    FLOPs over it (the chip at its peak everywhere). A libtpu figure <= 0 is its "no estimate"."""
    kernel_s = kernel_flops / t.peak_flops
    out = dict(kernel_s=kernel_s, step_s=None, mfu=None, roofline_s=None, mfu_bound=None)
    if cost.get("flops") is not None and cost.get("bytes accessed") is not None:
        roof = max((cost["flops"] + kernel_flops) / t.peak_flops,
                   cost["bytes accessed"] / t.bandwidth)
        bound = model_flops / (roof * t.peak_flops * t.chips)
        out.update(roofline_s=roof, mfu_bound=bound if bound <= 1 else None)
        if bound > 1:                        # the compiled FLOPs fall short of the model's
            out["mfu_bound_note"] = (f"model FLOPs {model_flops:.3g} above the compiled + kernel "
                                     f"{(cost['flops'] + kernel_flops) * t.chips:.3g}: no bound")
    opt = cost.get("optimal_seconds")
    if opt is not None and opt > 0:
        out["step_s"] = opt + kernel_s
        out["mfu"] = model_flops / (out["step_s"] * t.peak_flops * t.chips)
    elif opt is not None:
        out["mfu_note"] = f"libtpu gave optimal_seconds {opt:.3g}: no estimate"
    return out


def derive(rows: list[dict], tpf: float) -> None:
    """Streaming / AR step ratios at equal batch (roofline; libtpu's optimal_seconds where both
    have one) and the decode tokens/s estimates, in place."""
    opt = lambda r: (r.get("cost") or {}).get("optimal_seconds") or 0.0
    decode = [r for r in rows if r["kind"] == "decode"]
    ar = {(r["slots"], r["cache"]): r for r in decode if r["method"] == "ar"}
    for r in decode:
        if not r.get("roofline_s"):
            continue
        per_fwd = 1.0 if r["method"] == "ar" else tpf
        r["tokens_per_s"] = r["slots"] * per_fwd / r["roofline_s"]
        base = ar.get((r["slots"], r["cache"]))
        if r["method"] == "ar" or base is None or not base.get("roofline_s"):
            continue
        r["step_over_ar"] = r["roofline_s"] / base["roofline_s"]
        if opt(r) > 0 and opt(base) > 0:
            r["libtpu_step_over_ar"] = opt(r) / opt(base)


def _prepare_out(path: str) -> None:
    names = {"compile_for.json", "compile_for.md", "compile_for.png"}
    if os.path.isdir(path) and set(os.listdir(path)) - names:
        raise TargetError(f"--out {path} holds files this report did not write "
                          f"({', '.join(sorted(set(os.listdir(path)) - names)[:3])}); "
                          "pass another folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise TargetError(f"--out {path} is a file, not a folder")
    os.makedirs(path, exist_ok=True)


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _version(md, dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compiled.compile_for",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-for", required=True, help=f"comma-separated targets: {FORMS}")
    ap.add_argument("--model", default="8b", help="decode shape: 8b, 4b, 1.7b or 0.6b (benchmarks."
                                                   "shapes.DECODE_SHAPES), 7b (QWEN25_7B); "
                                                   "smoke: a 3-layer toy (tests)")
    ap.add_argument("--quick", action="store_true", help="AR and streaming W 16 at batch 8, "
                                                         "no prefill or train")
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--live", type=int, default=2048, help="committed rows per slot (the floor)")
    ap.add_argument("--tokens-per-forward", type=float, default=2.0,
                    help="streaming tokens per forward assumed for the tokens/s estimate")
    ap.add_argument("--page-size", type=int, default=None,
                    help="also compile every decode program with the paged cache of pages of "
                         "this many rows, on one chip")
    ap.add_argument("--programs", default="decode,prefill,train",
                    help="which programs: any of decode, prefill, train (--quick: decode)")
    ap.add_argument("--train-model", default="1b", help="the train step's shape: 1b "
                    "(benchmarks.shapes.TRAIN_SHAPE) or a --model name (8b: the released "
                    "WeDLM-8B's)")
    ap.add_argument("--lora-rank", type=int, default=0, help="also every decode program with a "
                    "LoRA adapter table of this rank (every slot's rows gathered; 0: none)")
    ap.add_argument("--lora-adapters", type=int, default=4, help="its adapters (with --lora-rank)")
    ap.add_argument("--train-lora", type=int, default=0, metavar="RANK",
                    help="also the LoRA train step at this rank, beside the full step")
    ap.add_argument("--quantize", default="none", choices=("none", "int8", "int4"),
                    help="the decode programs' weights (wedlm_jax.quantize; int4 in groups of 64)")
    ap.add_argument("--quantize-group", type=int, default=None,
                    help="its group size (0: a scale per output channel)")
    ap.add_argument("--out", default="benchmarks/results/compile_for")
    return ap


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    from benchmarks.shapes import DECODE_SHAPES, QWEN25_7B, SMOKE_SHAPE, model_config
    shapes = dict(DECODE_SHAPES, smoke=dict(SMOKE_SHAPE, num_layers=3))
    shapes["7b"] = QWEN25_7B
    try:
        if a.model not in shapes:
            raise TargetError(f"--model {a.model!r}: one of {', '.join(shapes)}")
        if a.train_model != "1b" and a.train_model not in shapes:
            raise TargetError(f"--train-model {a.train_model!r}: 1b or one of {', '.join(shapes)}")
        programs = {p.strip() for p in a.programs.split(",") if p.strip()}
        if not programs or programs - {"decode", "prefill", "train"}:
            raise TargetError(f"--programs {a.programs!r}: a comma-separated subset of decode, "
                              "prefill, train")
        if a.lora_rank < 0 or a.lora_adapters < 1:
            raise TargetError(f"--lora-rank {a.lora_rank} / --lora-adapters {a.lora_adapters}: "
                              "a rank >= 0 and at least one adapter")
        if a.train_lora < 0:
            raise TargetError(f"--train-lora {a.train_lora}: a rank >= 1, or 0 for none")
        if not 0 < a.live <= a.capacity:
            raise TargetError(f"--live {a.live} must be in [1, --capacity {a.capacity}]")
        if a.page_size is not None and not 1 <= a.page_size <= a.capacity:
            raise TargetError(f"--page-size {a.page_size} must be in [1, --capacity {a.capacity}]")
        if not a.tokens_per_forward >= 1:
            raise TargetError(f"--tokens-per-forward {a.tokens_per_forward} must be >= 1")
        names = [n.strip() for n in a.compile_for.split(",") if n.strip()]
        if not names:
            raise TargetError(f"--compile-for names no target; accepted: {FORMS}")
        targets = [describe(n) for n in names]       # every name checked before any compile
        _prepare_out(a.out)
    except TargetError as e:
        print(f"compile_for: {e}", file=sys.stderr)
        return 2
    import importlib.metadata as md

    import jax

    from decode.lora_options import LoraOptions
    lora = (LoraOptions(enable_lora=True, max_loras=a.lora_adapters, max_lora_rank=a.lora_rank)
            if a.lora_rank else None)
    config = model_config(shapes[a.model]).replace(max_position_embeddings=1 << 20)
    report = dict(command="python -m benchmarks.compiled.compile_for " + " ".join(argv or sys.argv[1:]),
                  jax=jax.__version__, libtpu=_version(md, "libtpu"),
                  cuda_plugin=_version(md, "jax-cuda12-plugin"), model=a.model, quantize=a.quantize,
                  tokens_per_forward=a.tokens_per_forward, targets=[])
    for t in targets:
        t0 = time.perf_counter()
        rows = [decode_row(config, t, prog, a.capacity, a.live, page, a.quantize,
                           a.quantize_group, table)
                for prog in decode_programs(a.quick)
                for page in ((None,) if a.page_size is None else (None, a.page_size))
                for table in ((None,) if lora is None else (None, lora))
                if "decode" in programs]
        if not a.quick and "prefill" in programs:
            rows.append(prefill_row(config, t, 2048))
        if not a.quick and "train" in programs:
            shape = None if a.train_model == "1b" else shapes[a.train_model]
            rows.append(train_row(t, shape=shape))
            if a.train_lora:
                rows.append(train_row(t, shape=shape, lora_rank=a.train_lora))
        derive(rows, a.tokens_per_forward)
        report["targets"].append(dict(
            target=t.name, chips=t.chips, hbm_gib=t.hbm / GIB, peak_tflops=t.peak_flops / 1e12,
            bandwidth_gbs=t.bandwidth / 1e9, compile_s=time.perf_counter() - t0, rows=rows))
        print(f"compile_for: {t.name}: {len(rows)} programs in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    _write(os.path.join(a.out, "compile_for.json"), json.dumps(report, indent=1))
    text = markdown(report)
    _write(os.path.join(a.out, "compile_for.md"), text)
    png = plot(report, os.path.join(a.out, "compile_for.png"))
    print(text + (f"\nplot: {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
