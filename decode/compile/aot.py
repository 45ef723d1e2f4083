"""The Decoder's programs compiled ahead of time from abstract shapes: no weights, no cache, no
device of the target needed (forced CPU devices, or a TPU topology jax describes with libtpu).

    compile_generate(config, devices, EngineOptions(...), Placement(...), live_rows=...)
        -> dict: XLA memory_analysis (bytes per device) and cost_analysis (flops, bytes accessed,
           libtpu's optimal_seconds where the compiler gives it) of one `generate` call of one
           step, the cache's size, and the analytic floor of that step (`step_floor`)
    compile_prefill(config, devices, engine, placement, prompt_len=...)
                                                 the same for one prompt's prefill
    unrolled_cost(compile_fn, config, *args, **kw)   cost figures of the whole network

`cost_analysis` counts a loop body once: the `generate` call of k = 1 step is one pass of the
decode loop's body, i.e. one decoding step, but its layer scan is counted once too, so its flops
and bytes are one layer plus the rest of the step. `unrolled_cost` compiles the same program with
the layer scan unrolled, which counts every layer; the memory figures come from the rolled
program (the one that runs).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from decode.config import DecodeConfigError
from decode.engine.planning import layouts
from wedlm_jax import model as model_lib
from wedlm_jax.buckets import pow2_at_least
from wedlm_jax.runtime.compiled import figures  # noqa: F401 (memory, cost and kernels of a program)
from wedlm_jax.runtime.failures import format_bytes

from wedlm_jax.runtime.targets import GIB, TargetError, describe_target, describe_tpu  # noqa: F401

DRY_RUN_CAPACITY = 2048   # a door without --capacity (wedlm-decode sizes it from its prompts)


def _device_list(devices) -> list:
    return list(devices) if isinstance(devices, (list, tuple)) else [devices]


def step_floor(static, live_rows: int, tensor: int = 1, batch_shards: int = 1) -> dict:
    """The bytes one decoding step cannot avoid moving, per device: every weight once (split over
    `tensor`; an untied input embedding only for the rows the step looks up), the live K/V of
    every slot (`live_rows` committed rows) once, the step's own K/V rows written, the logits
    written (K/V and logits split over the slots' `batch_shards` and the heads' / vocabulary's
    `tensor` shards). Quantized weights count as stored (values and scales), an int8 cache's rows
    with their scales."""
    from wedlm_jax import quantize
    from wedlm_jax.attention.kv_quant import row_bytes
    c = static.config
    not_read = 0 if c.tie_word_embeddings else max(c.vocab_size - static.slots * static.span, 0)
    shapes = quantize.quantize_params(model_lib.param_shapes(c, jnp.dtype(static.dtype)),
                                      static.quantize, static.quantize_group)
    embedding_row = quantize.weight_bytes(shapes["embedding"]) / c.vocab_size   # as stored
    weights = (quantize.weight_bytes(shapes) - not_read * embedding_row) / tensor
    kv_row = (2 * c.num_layers * c.num_kv_heads * row_bytes(c.head_dim, static.cache_dtype)
              / (tensor * batch_shards))
    kv = static.slots * live_rows * kv_row
    new = static.slots * static.span * kv_row
    logits = static.slots * static.span * c.vocab_size * 4 / (tensor * batch_shards)
    return dict(weights=weights, kv_read=kv, kv_written=new, logits=logits,
                total=weights + kv + new + logits)


def make_decoder(config, devices, engine, placement, *, scan_unroll: int = 1,
                 compiler_options: dict | None = None, continuous: bool = False, lora=None):
    """A Decoder over abstract weights (shapes only) for `devices`, built as `engine`
    (EngineOptions: the method, slots and capacity; its programs compiled for one step a call) and
    `placement` (Placement: one device, or its ('data', 'fsdp', 'tensor') mesh over the first
    devices; page_size None the plan's choice for the platform, 0 the dense cache; weight_layout
    resolved for the devices' platform: with "compiler" its `generate` is compiled here, with the
    weights' layouts left to the compiler, under `compiler_options`); `scan_unroll` layers per
    iteration of the layer scan; `continuous`: a continuous-batching door's plan (its "auto"
    cache); `lora`: LoraOptions (the adapter table beside the weights)."""
    from decode.engine.runtime.decoder import Decoder
    from decode.engine.planning.plan import make_plan
    from wedlm_jax.sharding import make_mesh
    devs = _device_list(devices)
    mesh = None
    if math.prod(placement.mesh) > 1:
        mesh = make_mesh(*placement.mesh, devices=devs[:math.prod(placement.mesh)])
    elif devs[0].platform != jax.default_backend():
        mesh = make_mesh(1, 1, 1, devices=devs[:1])   # the plan sees the target's device
    engine = engine.replace(steps_per_call=1, allow_long=True)
    plan = make_plan(config, engine, placement.replace(weight_layout="default"), mesh=mesh,
                     sampling=False, mask_token_id=config.vocab_size - 1,
                     memory_limit_bytes=1 << 62, continuous=continuous, lora=lora)
    if scan_unroll != 1:
        plan = plan.replace(scan_unroll=scan_unroll)
    dec = Decoder(model_lib.param_shapes(config, jnp.dtype(placement.dtype)), plan)
    if layouts.resolve(placement.weight_layout, devs[0].platform, placement.quantize != "none",
                       bool(lora and lora.enable_lora)) == "compiler":
        dec.use_compiler_layouts(compiler_options)
    return dec


def _shards(dec) -> tuple[int, int]:
    if dec.mesh is None:
        return 1, 1
    shape = dict(dec.mesh.shape)
    return int(shape.get("tensor", 1)), int(shape.get("data", 1)) * int(shape.get("fsdp", 1))


def generate_program(config, devices, engine, placement, *, scan_unroll: int = 1,
                     compiler_options: dict | None = None, continuous: bool = False, lora=None):
    """(Decoder, compiled `generate` of k = 1) of `make_decoder`'s Decoder for the devices'
    platform, compiled with `compiler_options`; with the weights in the compiler's layouts, the
    program that chose them (its `input_formats[0][0]`: the weights' formats)."""
    dec = make_decoder(config, devices, engine, placement, scan_unroll=scan_unroll,
                       compiler_options=compiler_options, continuous=continuous, lora=lora)
    compiled = dec.compiled_generate       # compiled already when the weights take its layouts
    if compiled is None:
        compiled = dec.compile("generate", compiler_options)
    return dec, compiled


def generate_figures(dec, compiled, live_rows: int | None = None) -> dict:
    """The figures of `generate_program`'s program (see the module docstring); `live_rows`
    (committed rows per slot) adds the step's floor per device."""
    from decode.engine.planning.memory import estimate_memory
    tensor, batch_shards = _shards(dec)
    platform = dec.mesh.devices.flat[0].platform if dec.mesh is not None else jax.default_backend()
    out = dict(platform=platform, method=dec.method, window=dec.window, refill=dec.refill, slots=dec.slots, capacity=dec.capacity, rows=dec.static.rows,
               dtype=jnp.dtype(dec.static.dtype).name, attention=dec.static.attention,
               page_size=dec.static.page_size, weight_layout=dec.weight_layout,
               compiler_options=dec.compiler_options,
               mesh=None if dec.mesh is None else dict(dec.mesh.shape),
               cache_bytes=estimate_memory(dec.static)["cache"] // (tensor * batch_shards),
               **figures(compiled))
    if live_rows is not None:
        out["floor"] = step_floor(dec.static, live_rows, tensor, batch_shards)
    return out


def compile_generate(config, devices, engine, placement, *, live_rows: int | None = None,
                     **program) -> dict:
    """Compile `generate` (k = 1) of `make_decoder`'s Decoder for the devices' platform and
    return its figures (`generate_program` with `program`'s keywords, `generate_figures`)."""
    return generate_figures(*generate_program(config, devices, engine, placement, **program),
                            live_rows=live_rows)


def compile_prefill(config, devices, engine, placement, *, prompt_len: int = 2048,
                    weight_formats=None, compiler_options: dict | None = None,
                    scan_unroll: int = 1, lora=None) -> dict:
    """Compile the prefill of one `prompt_len`-token prompt by `make_decoder`'s Decoder and
    return its figures (engine None: one slot of capacity `prompt_len`, the prompt one chunk).
    Cost_analysis counts one chunk's pass of one layer: see `unrolled_cost`, and scale by the
    chunk count when chunked. `weight_formats`: the weights' formats (a Decoder's in the
    compiler's layouts: `compile_generate`'s "weight_formats"); default row-major."""
    from decode.config import EngineOptions
    engine = engine or EngineOptions(slots=1, capacity=prompt_len, prefill_chunk=prompt_len)
    placement = placement.replace(weight_layout="default")   # `weight_formats` places them
    dec = make_decoder(config, devices, engine, placement, scan_unroll=scan_unroll, lora=lora)
    compiled = dec.compile("prefill", compiler_options, prompt_len=prompt_len,
                           params=_formatted(dec, "prefill", prompt_len, weight_formats))
    return dict(platform=dec.plan.device.platform, prompt_len=prompt_len,
                prefill_chunk=dec.static.prefill_chunk,
                mesh=None if dec.mesh is None else dict(dec.mesh.shape), **figures(compiled))


def compile_admission(dec, prompt_len: int, weight_formats=None,
                      compiler_options: dict | None = None) -> dict:
    """Compile a paged Decoder's admission of one `prompt_len`-token prompt (the "admit" program:
    its rows written into the pool through its page row, and for a window method the first fill,
    in the decode state the step runs on) and return its figures; `weight_formats` as in
    `compile_prefill`."""
    st = dec.static
    compiled = dec.compile("admit", compiler_options, prompt_len=prompt_len,
                           params=_formatted(dec, "admit", prompt_len, weight_formats))
    return dict(platform=dec.plan.device.platform, prompt_len=prompt_len,
                prefill_chunk=st.prefill_chunk, page_size=st.page_size, **figures(compiled))


def _formatted(dec, program: str, prompt_len: int, weight_formats):
    """The program's abstract weights in `weight_formats` (None: as the Decoder lays them out)."""
    if weight_formats is None:
        return None
    return layouts.place(dec.abstract_args(program, prompt_len=prompt_len)[0], weight_formats)


def unrolled_cost(compile_fn, config, *args, **kwargs) -> dict:
    """The cost of the whole depth: `compile_fn` with the layer scan fully unrolled (XLA's
    cost_analysis counts a loop body once, so the rolled program reports one layer). Extrapolating
    from 1- and 2-layer compiles was tried and is not linear on TPU (fusion changes with depth:
    BENCHMARKS.md section 7). Loops
    with a runtime trip count stay counted once: the cache attention's tile loop counts one KV
    tile per row (`kv_not_counted`). Where libtpu gives no time (optimal_seconds <= 0: ops it
    does not cost, in deep multi-chip programs memory-space assignment's sliced prefetches) the
    program is compiled again with `wedlm_jax.runtime.compiled.estimate_options` and its time taken
    (flops and bytes stay the real program's), marked {"optimal_from": "estimate_options"}.
    {} when the compiler reports no cost (XLA:GPU)."""
    from wedlm_jax.runtime.compiled import estimate_options
    out = compile_fn(config, *args, scan_unroll=config.num_layers, **kwargs)
    cost = out.get("cost") or {}
    options = estimate_options(out.get("platform", ""))
    if cost.get("optimal_seconds", 1.0) <= 0 and options and "compiler_options" not in kwargs:
        again = compile_fn(config, *args, scan_unroll=config.num_layers, compiler_options=options,
                           **kwargs).get("cost") or {}
        cost = dict(cost, optimal_seconds=again.get("optimal_seconds"),
                    optimal_seconds_as_compiled=cost["optimal_seconds"],
                    optimal_from="estimate_options")
    return cost


def kv_not_counted(slots: int, config, live_rows: int, kv_tile: int, dtype: str,
                   tensor: int = 1, batch_shards: int = 1) -> float:
    """Bytes of live K/V a decode step reads that cost_analysis does not count: every live tile
    past the first of each row and layer (the tile loop's trip count is a runtime value)."""
    item = jnp.dtype(dtype).itemsize
    kv_row = 2 * config.num_layers * config.num_kv_heads * config.head_dim * item
    rows = max(live_rows - kv_tile, 0)
    return slots * rows * kv_row / (tensor * batch_shards)


def dry_run(config, target: str, engine, placement, *, device_memory_gib: float | None = None,
            who: str = "wedlm-serve", continuous: bool = True, lora=None) -> tuple[str, bool]:
    """The programs a decoding door runs (one decode step of `generate`, one prompt's prefill at
    the largest bucket: with a paged cache its admission into pages, `compile_admission`)
    compiled for an accelerator (a TPU topology, or GPUs: wedlm_jax.runtime.targets) from config.json
    alone, laid out as `placement` says; (report text, fits). `continuous`: the door batches
    continuously (the server, the batch job), whose default cache may differ from a static
    batch's. `lora`: the door's LoraOptions (with --enable-lora the adapter table is among the
    weights). An out-of-memory compile is the verdict, not an error."""
    devices, chip = describe_target(target)
    hbm = chip.hbm
    if placement.devices_needed > len(devices):
        raise TargetError(f"--mesh needs {placement.devices_needed} devices; {target} has "
                          f"{len(devices)}")
    limit = int(device_memory_gib * GIB) if device_memory_gib else hbm
    devs = devices[:placement.devices_needed]
    adapters = bool(lora and lora.enable_lora)
    try:
        layout = layouts.resolve(placement.weight_layout, devices[0].platform,
                                 placement.quantize != "none", adapters)
    except ValueError as e:
        raise DecodeConfigError(str(e), "weight_layout") from None
    lines = [f"{who} dry run for {target}: {len(devs)} of its {len(devices)} chips, "
             f"{format_bytes(limit, 'GiB')} each; mesh data={placement.mesh[0]} "
             f"fsdp={placement.mesh[1]} "
             f"tensor={placement.mesh[2]}, {placement.dtype}"
             + (f" weights quantized {placement.quantize}" if placement.quantize != "none" else "")
             + (f", KV cache {placement.kv_dtype}" if placement.kv_dtype != "auto" else "")
             + (f", LoRA table {lora.rows} adapters x rank {lora.rank}" if adapters else "")
             + ", cache attention "
             f"{placement.attention}, weights "
             f"{layout}"
             f" layout; {engine.method} W {engine.window} refill {engine.refill}, {engine.slots} "
             f"slots x capacity {engine.capacity}"]
    capacity = engine.capacity
    prompt = min(pow2_at_least(capacity, 2), capacity + 2 * engine.window)

    made = {}

    def step():
        dec, compiled = generate_program(config, devs, engine, placement, continuous=continuous,
                                         lora=lora)
        made["decoder"] = dec
        lines[0] += step_note(dec, placement)
        return dict(generate_figures(dec, compiled), weight_formats=(
            compiled.input_formats[0][0] if dec.weight_layout == "compiler" else None))

    step_figures = verdict(step)
    formats = step_figures.pop("weight_formats") if isinstance(step_figures, dict) else None
    dec = made.get("decoder")
    if dec is not None and dec.paged:   # the door admits into pages (and runs the first fill)
        bucket = dec.prompt_bucket(prompt)
        results = [("decode step", step_figures),
                   (f"admission of a {bucket}-token prompt", verdict(lambda: compile_admission(
                       dec, bucket, formats)))]
    else:      # the dense prefill; it reads the weights as the step laid them
        results = [("decode step", step_figures),
                   (f"prefill of a {prompt}-token prompt", verdict(lambda: compile_prefill(
                       config, devs, engine.replace(prefill_chunk=min(engine.prefill_chunk, prompt)),
                       placement.replace(page_size=0, num_pages=None), prompt_len=prompt,
                       weight_formats=formats, lora=lora)))]
    fits, rows = verdict_lines(results, limit)
    return "\n".join(lines + rows), fits


def verdict(compile_fn):
    """A program's figures, or the compiler's out-of-memory message (a verdict, not an error)."""
    from wedlm_jax.runtime.failures import out_of_memory
    try:
        return compile_fn()
    except Exception as e:  # noqa: BLE001 - only an out-of-memory compile is a verdict
        reason = out_of_memory(e)
        if reason is None:
            raise
        return reason


def step_note(dec, placement) -> str:
    """What the dry run's headline says of the step: the cache and the compiler options."""
    note = (f"; paged cache, pages of {dec.static.page_size} rows"
            + (" (the platform's choice)" if placement.page_size is None else "")
            if dec.paged else "; dense cache")
    if dec.compiler_options:
        note += "; step compiled with " + ", ".join(
            f"{k}={v}" for k, v in sorted(dec.compiler_options.items()))
    return note


def verdict_lines(results, limit: int) -> tuple[bool, list[str]]:
    """(fits, a line per program and the verdict) of [(label, figures or out-of-memory text)]."""
    fits, lines = True, []
    for label, f in results:
        if isinstance(f, str):
            lines.append(f"  {label:<34} DOES NOT FIT: the compiler ran out of memory: {f}")
            fits = False
            continue
        m = f["memory"]
        ok = m["total"] <= limit
        fits = fits and ok
        lines.append(f"  {label:<34} {format_bytes(m['total'], 'GiB'):>12} per chip (arguments "
                     f"{format_bytes(m['argument'], 'GiB')}, temporaries "
                     f"{format_bytes(m['temp'], 'GiB')})"
                     + ("" if ok else "  DOES NOT FIT"))
    lines.append(f"  verdict      {'FITS' if fits else 'DOES NOT FIT'} in "
                 f"{format_bytes(limit, 'GiB')} per chip")
    return fits, lines


def dry_run_door(args, who: str) -> int:
    """`--dry-run --topology T` of a decoding door (wedlm-decode, its batch job, wedlm-serve):
    the door's decode step and prefill compiled for T from config.json with the door's own
    settings and placement, per-chip memory and a verdict; exit 0 (fits), 1 (does not), 2 (bad
    input, one line)."""
    import os
    import sys
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # compile-only devices: no local TPU backend
    from decode.checkpoint import check_quantized_folder
    from decode.config import EngineOptions, Placement
    from decode.lora_options import LoraOptions
    from wedlm_jax.config import ConfigError
    from wedlm_jax.checkpoints import CheckpointError, read_config
    try:
        if not args.topology:
            raise DecodeConfigError("--dry-run needs --topology (e.g. v5e:2x4)")
        config = read_config(args.checkpoint)
        placement = Placement.from_args(args)
        check_quantized_folder(args.checkpoint, placement, placement.check_model(config))
        engine = EngineOptions(method=args.method, window=args.window, refill=args.refill,
                               slots=args.slots, capacity=args.capacity or DRY_RUN_CAPACITY,
                               prefill_chunk=args.prefill_chunk)
        lora = LoraOptions.from_args(args)
        text, fits = dry_run(config, args.topology, engine, placement,
                             device_memory_gib=args.device_memory, who=who,
                             continuous=who == "wedlm-serve" or bool(getattr(args, "input", None)),
                             lora=lora)
    except (DecodeConfigError, ConfigError, TargetError, FileNotFoundError, CheckpointError) as e:
        print(f"{who}: error: {e}", file=sys.stderr)
        return 2
    print(text, flush=True)
    return 0 if fits else 1
