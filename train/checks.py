"""The training config's value checks: each `check_*(cfg, bad)` calls `bad(key, message)` for the
first value it refuses, with no device, no files and no compilation (`train.config.validate` runs
them all and raises `TrainConfigError`). The allowed values are defined here, once."""

from __future__ import annotations

import math

from wedlm_jax.dtypes import canonical
from wedlm_jax.attention.table import IMPLEMENTATIONS
from wedlm_jax.axis_rules import MESH_AXES

OBJECTIVES = ("dual_stream", "plain", "ar_only")
COMPUTE_DTYPES = ("bfloat16", "float32")
PARAM_DTYPES = ("float32",)
ATTENTION = IMPLEMENTATIONS    # the kernel table's backends and auto (wedlm_jax/attention/table.py)
# the layer scan's remat policy: wedlm_jax.model.REMAT_POLICIES (which loads jax), equal by a test
REMAT = ("full", "save_dots", "none")


def check_model(cfg, bad) -> None:
    given = [k for k in ("from_hf", "from_orbax", "config") if getattr(cfg.model, k) is not None]
    if not given:
        bad("model", "needs model.from_hf (a Hugging Face folder), model.from_orbax (an Orbax "
                     "folder of wedlm-convert) or model.config (an inline architecture for "
                     "training from scratch)")
    if len(given) > 1:
        bad("model", f"takes one of model.from_hf, model.from_orbax, model.config; got "
                     f"{', '.join('model.' + k for k in given)}")


def check_objective(cfg, bad) -> None:
    ob = cfg.objective
    if ob.kind not in OBJECTIVES:
        bad("objective.kind", f"must be one of {', '.join(OBJECTIVES)}, got {ob.kind!r}")
    if ob.block_size < 1:
        bad("objective.block_size", f"must be >= 1, got {ob.block_size}")
    if ob.ar_weight < 0:
        bad("objective.ar_weight", f"(a loss weight) must be >= 0, got {ob.ar_weight}")
    if ob.kind == "ar_only" and ob.ar_weight == 0:
        bad("objective.ar_weight", "must be > 0 for objective.kind=ar_only (it is the only loss)")
    if not 0 < ob.eps <= 1:
        bad("objective.eps", f"must be in (0, 1], got {ob.eps}")


def check_optimizer(cfg, bad) -> None:
    o = cfg.optimizer
    if cfg.steps < 1:
        bad("steps", f"must be >= 1, got {cfg.steps}")
    if o.lr <= 0 or o.final_lr < 0:
        bad("optimizer.lr", f"must be > 0 (and optimizer.final_lr >= 0), got lr={o.lr}, "
                            f"final_lr={o.final_lr}")
    if o.warmup_steps is not None and o.warmup_ratio is not None:
        bad("optimizer.warmup_steps", "and optimizer.warmup_ratio are exclusive; set one")
    if o.warmup_steps is not None and o.warmup_steps < 0:
        bad("optimizer.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    if o.warmup_ratio is not None and not 0 <= o.warmup_ratio <= 1:
        bad("optimizer.warmup_ratio", f"must be in [0, 1], got {o.warmup_ratio}")
    if cfg.warmup > cfg.steps:
        bad("optimizer.warmup_steps", f"({cfg.warmup}) exceeds the total steps ({cfg.steps})")
    if o.weight_decay < 0:
        bad("optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")
    if o.clip < 0:
        bad("optimizer.clip", f"must be >= 0 (0 disables clipping), got {o.clip}")
    if o.grad_accum < 1:
        bad("optimizer.grad_accum", f"must be >= 1, got {o.grad_accum}")
    if o.mu_dtype is not None and canonical(o.mu_dtype) not in COMPUTE_DTYPES:
        bad("optimizer.mu_dtype", f"must be null (the params' dtype), bf16 or f32, got {o.mu_dtype!r}")
    for name in ("b1", "b2"):
        if not 0 <= getattr(o, name) < 1:
            bad(f"optimizer.{name}", f"must be in [0, 1), got {getattr(o, name)}")


def check_data(cfg, bad) -> None:
    d, o, ob = cfg.data, cfg.optimizer, cfg.objective
    if d.seq_len < 2:
        bad("data.seq_len", f"must be >= 2, got {d.seq_len}")
    if ob.kind != "ar_only" and ob.block_size > d.seq_len:
        bad("objective.block_size", f"({ob.block_size}) exceeds data.seq_len ({d.seq_len}): a "
                                    f"block must fit in a packed row")
    if d.global_batch_size < 1:
        bad("data.global_batch_size", f"must be >= 1, got {d.global_batch_size}")
    if d.global_batch_size % o.grad_accum:
        bad("data.global_batch_size", f"({d.global_batch_size}) must be a multiple of "
                                      f"optimizer.grad_accum ({o.grad_accum})")
    if d.packed_dir is not None and d.train_files:
        bad("data.packed_dir", "and data.train_files are exclusive; set one (packed_dir: a folder "
                               "written by `python -m train.data.pretokenize`)")
    if d.packed_dir is None and not d.train_files:
        bad("data.train_files", "is empty; list one or more JSONL files (or set data.packed_dir to "
                                "a pretokenized folder)")


def check_run(cfg, bad) -> None:
    m, c = cfg.mesh, cfg.checkpoint
    for name in MESH_AXES:
        v = getattr(m, name)
        if v == 0 or v < -1 or (v == -1 and name != "data"):
            bad(f"mesh.{name}", f"must be >= 1{' or -1 (fill)' if name == 'data' else ''}, got {v}")
    if canonical(cfg.compute_dtype) not in COMPUTE_DTYPES:
        bad("compute_dtype", f"must be one of bf16, f32 (bfloat16, float32), got {cfg.compute_dtype!r}")
    if canonical(cfg.param_dtype) not in PARAM_DTYPES:
        bad("param_dtype", f"must be f32 (float32: master weights), got {cfg.param_dtype!r}")
    if cfg.attention not in ATTENTION:
        bad("attention", f"must be one of {', '.join(ATTENTION)}, got {cfg.attention!r}")
    if cfg.remat not in REMAT:
        bad("remat", f"must be one of {', '.join(REMAT)} (or true / false: full / none), got "
                     f"{cfg.remat!r}")
    if cfg.loss_chunk < 0 or (cfg.loss_chunk and cfg.data.seq_len % cfg.loss_chunk):
        bad("loss_chunk", f"must be 0 (full logits) or a divisor of data.seq_len "
                          f"{cfg.data.seq_len}, got {cfg.loss_chunk}")
    if cfg.attention_tile < 8:
        bad("attention_tile", f"must be >= 8, got {cfg.attention_tile}")
    if c.every < 1 or c.keep < 1:
        bad("checkpoint.every", f"and checkpoint.keep must be >= 1, got every={c.every}, keep={c.keep}")
    if cfg.log_every < 1:
        bad("log_every", f"must be >= 1, got {cfg.log_every}")
    if cfg.peak_flops is not None and cfg.peak_flops <= 0:
        bad("peak_flops", f"must be > 0, got {cfg.peak_flops}")
    if cfg.time_limit_s is not None and not 0 < cfg.time_limit_s < float("inf"):
        bad("time_limit_s", f"must be a number of seconds > 0 (or null), got {cfg.time_limit_s}")
    if cfg.nonfinite_skips < 0:
        bad("nonfinite_skips", f"must be >= 0, got {cfg.nonfinite_skips}")


def check_lora(cfg, bad) -> None:
    """lora.rank 0 (off) or a LoraSpec's ranges and targets (wedlm_jax.lora.spec), and the frozen
    base's quantization: decoding's schemes and group sizes (wedlm_jax.quantize_scheme; whether
    the group tiles the model is checked with the model config, train.config.check_base_quantize)."""
    from wedlm_jax.lora.spec import LoraError, LoraSpec
    from wedlm_jax.quantize_scheme import QuantizeError, resolve_group
    lo = cfg.lora
    if lo.rank == 0:
        if lo.base_quantize != "none":
            bad("lora.base_quantize", f"{lo.base_quantize!r} quantizes LoRA's frozen base and "
                                      f"needs lora.rank > 0; with lora.rank 0 every weight is "
                                      f"trained in float")
        if lo.base_quantize_group is not None:
            bad("lora.base_quantize_group", f"{lo.base_quantize_group} needs lora.rank > 0 and "
                                            f"lora.base_quantize int8 or int4")
        return
    try:
        LoraSpec(lo.rank, lo.alpha, lo.dropout, lo.targets)
    except LoraError as e:
        bad(e.field, str(e).split(" ", 1)[1] if str(e).startswith(e.field) else str(e))
    try:
        resolve_group(lo.base_quantize, lo.base_quantize_group)
    except QuantizeError as e:
        bad(f"lora.base_{e.field}", str(e).split(" ", 1)[1].replace(
            "scheme: quantize", "scheme: lora.base_quantize"))


STEP_MAX = 2 ** 31 - 1      # the train state's step counter is int32


def check_numbers(cfg, bad) -> None:
    """Every number of the config finite, and the step counts within the state's int32 counter:
    `lr: nan` or `steps: 1e30` is refused here, before the model loads."""
    for key, value in _numbers(cfg.to_dict()):
        if isinstance(value, float) and not math.isfinite(value):
            bad(key, f"must be a finite number, got {value}")
    for key, value in (("steps", cfg.steps), ("checkpoint.every", cfg.checkpoint.every),
                       ("log_every", cfg.log_every)):
        if value > STEP_MAX:
            bad(key, f"must be at most {STEP_MAX} (the step counter is int32), got {value}")


def _numbers(tree, prefix=""):
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _numbers(v, key + "." if k != "config" else key + ".")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield key, v


CHECKS = (check_model, check_objective, check_optimizer, check_data, check_run, check_numbers,
          check_lora)
