"""`wedlm-train --config C.yaml --dry-run --device-memory 80 [--devices N] [--topology T]`:
compile the train step of a config from abstract shapes, before any weight or data is read.

The config's mesh, batch, sequence length, grad_accum, dtypes, attention and remat are taken as
they are. The model architecture comes from the inline `model.config`, or from `config.json` of
`model.from_hf` (only that file is read: a folder holding just config.json, e.g.
`configs/arch/qwen3-8b`, is enough). The state (f32 params, AdamW moments, step) and the batch are
`jax.ShapeDtypeStruct`s with their shardings; the jitted step (`train.step.make_train_step`, the
one the program runs) is lowered and compiled on the mesh, and XLA's per-device memory analysis,
its FLOP count, the compile time and a verdict against `--device-memory` GiB are printed. Exit 0
when it fits, 1 when it does not (with the numbers), 2 on bad input (named before compiling).

Devices: by default N CPU devices are forced (`--xla_force_host_platform_device_count`, set before
JAX starts), N = --devices or, by default, data x fsdp x tensor of the mesh (data=-1 counts 1).
`--topology NAME` (a TPU topology such as `v5e:4x4` or `tpu:v5p:2x2x2`, or GPUs: `h100`, `h100:8`;
wedlm_jax.runtime.targets) compiles for that accelerator described without the hardware (TPU needs libtpu,
GPUs jax's CUDA plugin); an unknown name is refused with the accepted forms, a target whose
compiler is not installed with the install command.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from wedlm_jax.runtime import compiled as compiled_lib
from wedlm_jax.runtime.failures import GIB, format_bytes, out_of_memory  # the verdict's one-line reason

FORCE_FLAG = "--xla_force_host_platform_device_count"


# ----------------------------------------------------------------------------- before JAX starts

def add_arguments(parser) -> None:
    """wedlm-train's dry-run options."""
    d = parser.add_argument_group("dry run (train/dry_run.py): compile the step from abstract shapes, "
                                "read no weights and no data")
    d.add_argument("--dry-run", action="store_true",
                   help="print per-device memory, FLOPs and compile time of the train step, and "
                        "whether it fits --device-memory; exit 1 when it does not")
    d.add_argument("--device-memory", type=float, help="GiB of memory per device (e.g. 80)")
    d.add_argument("--devices", type=int,
                   help="forced CPU devices (default: data x fsdp x tensor of the mesh)")
    d.add_argument("--topology", help="an accelerator topology jax can describe without the "
                                      "hardware, e.g. tpu:v5e:4x4 (needs libtpu)")
    d.add_argument("--json", dest="json_out", help="also write the figures as JSON here")


DRY_RUN_FLAGS = (("--device-memory", "device_memory"), ("--devices", "devices"),
                 ("--topology", "topology"), ("--json", "json_out"))


def refusal(args) -> str | None:
    """The refusal of a dry-run flag given without --dry-run (it would be ignored), else None."""
    if args.dry_run:
        return None
    for flag, name in DRY_RUN_FLAGS:
        if getattr(args, name) is not None:
            return (f"{flag} goes with --dry-run (compile the step and say if it fits); without "
                    f"--dry-run it would be ignored: add --dry-run or drop {flag}")
    return None



def devices_needed(cfg, devices: int | None) -> int:
    """The device count of the dry run: --devices, else the mesh's (data=-1 counts as 1)."""
    from train.config import TrainConfigError
    if devices is not None:
        if devices < 1:
            raise TrainConfigError(f"--devices must be >= 1, got {devices}")
        return devices
    m = cfg.mesh
    return max(m.data, 1) * m.fsdp * m.tensor


def force_host_devices(n: int) -> None:
    """Make JAX (not yet started) see `n` CPU devices; a TrainConfigError saying how when JAX
    already runs with fewer."""
    from train.config import TrainConfigError
    if "jax" in sys.modules and _backends_started():
        import jax
        have = jax.device_count()
        if have < n:
            raise TrainConfigError(
                f"the dry run needs {n} devices and JAX already started with {have}; run it as its "
                f"own process (python -m train.main ... --dry-run), or start Python with "
                f"XLA_FLAGS={FORCE_FLAG}={n} JAX_PLATFORMS=cpu")
        return
    flags = re.sub(FORCE_FLAG + r"=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {FORCE_FLAG}={n}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def _backends_started() -> bool:
    """Has JAX created its device clients (after which XLA_FLAGS no longer applies)? Importing jax
    alone does not: the flags are read when the first backend starts."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def describe_topology(name: str):
    """The devices of a named accelerator ('tpu:v5e:4x4', 'v5p:2x2x2', 'h100:8', 'cuda:h100'),
    described without the hardware (wedlm_jax.runtime.targets); a TrainConfigError naming the accepted
    forms or the compiler to install otherwise."""
    from train.config import TrainConfigError
    from wedlm_jax.runtime.targets import TargetError, describe_target
    try:
        return describe_target(name)[0]
    except TargetError as e:
        raise TrainConfigError(f"--topology {e}") from None


# ----------------------------------------------------------------------------------- the dry run

def model_config_for(cfg):
    """The ModelConfig without weights: inline fields, or the model folder's config.json only."""
    from train.config import TrainConfigError, model_config
    if cfg.model.folder is not None:
        path = os.path.join(cfg.model.folder, "config.json")
        if not os.path.isfile(path):
            key = "model.from_hf" if cfg.model.from_hf is not None else "model.from_orbax"
            raise TrainConfigError(
                f"{key}: {path} does not exist; the dry run reads only the architecture "
                f"(config.json), e.g. model.from_hf=configs/arch/qwen3-8b or "
                f"model.from_hf=configs/arch/qwen2.5-7b")
    mc = model_config(cfg)
    if cfg.objective.kind != "ar_only" and mc.mask_token_id is None:
        mc = mc.replace(mask_token_id=mc.vocab_size - 1)  # a placeholder: shapes do not depend on it
    return mc


def compile_step(cfg, mc, devices, scan_unroll: int = 1, compiler_options: dict | None = None):
    """(compiled, lower_s, compile_s, mesh shape) of the train step over `devices`, from abstract
    state and batch (ShapeDtypeStructs carrying their shardings); `scan_unroll` layers per
    iteration of the layer scan (cost analysis counts a loop body once); `compiler_options` passed
    to the compiler (`wedlm_jax.runtime.compiled.estimate_options` for a program compiled to be costed)."""
    import jax
    import jax.numpy as jnp

    from train import lora as lora_train
    from train import step as step_lib
    from train.config import mesh_shape
    from wedlm_jax.sharding import make_mesh

    shape = mesh_shape(cfg, len(devices))
    step_lib.attention_impl(cfg, backend=devices[0].platform)
    mesh = make_mesh(*shape, devices=devices)
    opt, spec = step_lib.make_optimizer(cfg), lora_train.spec_of(cfg)
    shardings = step_lib.state_shardings(mc, opt, mesh, lora=spec)
    state = step_lib.state_shapes(mc, opt, shardings, lora=spec)
    bsh = step_lib.batch_shardings(mesh)
    b, length = cfg.data.global_batch_size, cfg.data.seq_len
    dtypes = {"tokens": jnp.int32, "segment_ids": jnp.int32, "maskable": jnp.bool_,
              "index": jnp.int32}
    batch = {k: jax.ShapeDtypeStruct((b,) if k == "index" else (b, length), dtypes[k],
                                     sharding=bsh[k]) for k in step_lib.BATCH_KEYS}
    fn = step_lib.make_train_step(cfg, mc, opt, mesh, shardings, mc.mask_token_id,
                                  platform=devices[0].platform, scan_unroll=scan_unroll,
                                  base=lora_train.base_shapes(cfg, mc, mesh) if spec else None)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = fn.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options)
    t2 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1, shape


def step_flops(compiled) -> float | None:
    return compiled_lib.cost(compiled).get("flops")


def report(cfg, devices_arg=None, topology=None) -> dict:
    """Everything the dry run prints, as a dict (bytes, seconds, FLOPs)."""
    import jax

    from train import step as step_lib

    mc = model_config_for(cfg)
    if topology:
        devices = describe_topology(topology)
        where = f"{len(devices)} {devices[0].platform} devices of topology {topology}"
    else:
        n = devices_needed(cfg, devices_arg)
        devices = jax.devices()[:n]
        where = f"{n} {devices[0].platform} devices"
    compiled, lower_s, compile_s, shape = compile_step(cfg, mc, devices)
    data, fsdp, tensor = shape
    rows = cfg.data.global_batch_size // cfg.optimizer.grad_accum // (data * fsdp)
    model_flops = step_lib.model_flops_per_row(mc, cfg.data.seq_len, cfg.objective.kind,
                                               cfg.objective.block_size) * cfg.data.global_batch_size
    return {"params": mc.num_params(), "num_layers": mc.num_layers, "seq_len": cfg.data.seq_len,
            "objective": cfg.objective.kind, "remat": cfg.remat, "compute_dtype": cfg.compute_dtype,
            "attention": step_lib.attention_impl(cfg, backend=devices[0].platform),
            "mesh": {"data": data, "fsdp": fsdp, "tensor": tensor}, "devices": where,
            "global_batch_size": cfg.data.global_batch_size,
            "grad_accum": cfg.optimizer.grad_accum, "rows_per_device_microbatch": rows,
            "lower_s": lower_s, "compile_s": compile_s, "memory": compiled_lib.memory(compiled),
            "kernels": compiled_lib.kernels(compiled),
            "step_flops_per_device": step_flops(compiled), "model_flops_per_step": model_flops,
            "lora": lora_summary(cfg)}


def lora_summary(cfg) -> str | None:
    """'rank 16 on all-linear, the base frozen int4 (groups of 64)' for a LoRA step, else None."""
    if not cfg.lora.rank:
        return None
    from train.lora import base_scheme
    from wedlm_jax.quantize import describe
    scheme, group = base_scheme(cfg)
    frozen = f"in {cfg.compute_dtype}" if scheme == "none" else describe(scheme, group)
    return f"rank {cfg.lora.rank} on {', '.join(cfg.lora.targets)}, the base frozen {frozen}"


def format_report(r: dict, device_memory_gib: float, source: str) -> tuple[str, bool]:
    def size(x):                        # the memory table's column: GiB and the exact bytes
        return f"{format_bytes(x, 'GiB'):>13}  ({x} B)"

    def gib(x):
        return format_bytes(x, "GiB")
    m = r["memory"]
    fits = m["total"] <= device_memory_gib * GIB
    flops = r["step_flops_per_device"]
    lines = [
        f"wedlm-train dry run of {source}",
        f"  model        {r['params'] / 1e9:.2f}B parameters, {r['num_layers']} layers; "
        f"seq_len {r['seq_len']} ({r['objective']}); remat {r['remat']}; compute "
        f"{r['compute_dtype']}; attention {r['attention']}",
        f"  mesh         data={r['mesh']['data']} fsdp={r['mesh']['fsdp']} "
        f"tensor={r['mesh']['tensor']} on {r['devices']}; global batch {r['global_batch_size']} "
        f"rows, grad_accum {r['grad_accum']}: {r['rows_per_device_microbatch']} row(s) per device "
        f"per microbatch",
        *([f"  lora         {r['lora']}"] if r.get("lora") else []),
        f"  compile      {r['lower_s']:.1f} s lowering + {r['compile_s']:.1f} s compiling",
        "  kernels      " + (", ".join(f"{k} x{n}" for k, n in r["kernels"].items())
                             or "none (plain XLA ops only)") + " (custom calls in the compiled HLO)",
        "  memory per device (XLA memory_analysis):",
        f"    arguments    {size(m['argument'])}",
        f"    outputs      {size(m['output'])}",
        f"    aliased      {size(m['alias'])}  (donated state, updated in place)",
        f"    temporaries  {size(m['temp'])}",
        f"    total        {size(m['total'])}  (arguments + outputs - aliased + temporaries)",
        f"  step FLOPs   {flops:.4g} per device (XLA cost_analysis); model FLOPs "
        f"{r['model_flops_per_step']:.4g} per step (train.step.model_flops_per_row)"
        if flops is not None else "  step FLOPs   not reported by XLA for this backend",
    ]
    if fits:
        lines.append(f"  verdict      FITS: {gib(m['total'])} <= --device-memory "
                     f"{device_memory_gib:g} GiB ({gib(device_memory_gib * GIB - m['total'])} left)")
    else:
        lines.append(f"  verdict      DOES NOT FIT: {gib(m['total'])} > --device-memory "
                     f"{device_memory_gib:g} GiB (arguments {gib(m['argument'])} + temporaries "
                     f"{gib(m['temp'])} + unaliased outputs {gib(m['output'] - m['alias'])})")
    return "\n".join(lines), fits


def mixture_shares(cfg) -> str | None:
    """The token shares of `data.packed_dir` when it is a mixture file (meta.json and shard
    indexes only), with the epochs of each folder the configured steps read; None otherwise."""
    from train.data import mixture, packed
    d = cfg.data
    if not d.packed_dir or not packed.is_mixture(d.packed_dir):
        return None
    meta = mixture.read_mixture_meta(d.packed_dir, seq_len=d.seq_len)
    return mixture.format_shares(mixture.shares(meta, cfg.steps, d.global_batch_size))


def run(cfg, device_memory_gib: float, devices=None, topology=None, json_out=None,
        source: str = "config") -> int:
    """Compile, print, write JSON; 0 when the step fits, 1 when it does not (including a compile
    the target's compiler refuses for want of memory: that is the verdict, with its figures)."""
    shares = mixture_shares(cfg)
    if shares:
        print(f"data mixture {cfg.data.packed_dir} over {cfg.steps} steps\n{shares}", flush=True)
    try:
        r = report(cfg, devices, topology)
    except Exception as e:   # noqa: BLE001 (only an out-of-memory compile is a verdict)
        reason = out_of_memory(e)
        if reason is None:
            raise
        where = topology or f"{devices_needed(cfg, devices)} forced CPU devices"
        print(f"wedlm-train dry run of {source}\n  devices      {where}\n  verdict      DOES NOT FIT: "
              f"the compiler ran out of device memory: {reason}", flush=True)
        if json_out:
            with open(json_out, "w") as f:
                json.dump(dict(source=source, devices=where, device_memory_gib=device_memory_gib,
                               fits=False, compiler_out_of_memory=reason), f, indent=1)
        return 1
    text, fits = format_report(r, device_memory_gib, source)
    print(text, flush=True)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(dict(r, device_memory_gib=device_memory_gib, fits=fits), f, indent=1)
    return 0 if fits else 1
