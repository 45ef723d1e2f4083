"""LoRA training: the frozen base beside the trained adapters (wedlm_jax/lora/apply.py).

With `lora.rank` > 0 the train state's `params` are the adapters alone (float32 master weights),
so the optimizer keeps moments for them only; the base is loaded once, cast to the compute dtype,
placed in its usual shardings and passed to the jitted step as an argument that is neither
donated nor differentiated (train/step.py). The objective, both losses and the dual-stream
arrangement are the full step's.

The base is fingerprinted (`fingerprint`: an exact integer hash of every weight's bits, the same
on any mesh) and the fingerprint is written into every checkpoint's saved config
(`lora.base_hash`); a run whose base differs from the one its checkpoint.dir was trained on is
refused by name before anything is restored (`check_base`). A config may also set
`lora.base_hash` itself to pin the base.

QLoRA: with `lora.base_quantize` int8 or int4 the base, once cast to the compute dtype, is
quantized by `wedlm_jax.quantize.quantize_params` (decoding's function and schemes, each float
kernel freed once quantized) and placed in the shardings of its quantized shapes; the projections
read it as decoding does, the adapters' term added beside (wedlm_jax/lora/apply.py `Provider`). The
fingerprint is the quantized base's (its integer values' and scales' bits), so a checkpoint
trained on one quantization refuses to resume on another, or on the float base.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from train.config import compute_dtype
from wedlm_jax.lora import apply as lora_lib
from wedlm_jax import model as model_lib
from wedlm_jax import quantize
from wedlm_jax.axis_rules import DEFAULT_RULES
from wedlm_jax.lora.spec import LoraSpec
from wedlm_jax.quantize_scheme import resolve_group
from wedlm_jax.sharding import tree_shardings

log = logging.getLogger("wedlm-train")


def spec_of(cfg) -> LoraSpec | None:
    """The LoraSpec of the config's `lora` section, None when LoRA is off (rank 0)."""
    lo = cfg.lora
    return LoraSpec(lo.rank, lo.alpha, lo.dropout, lo.targets) if lo.rank else None


def trainable_trees(model_cfg, spec: LoraSpec | None):
    """(shapes, logical axes) of what the optimizer trains: the adapters under `spec`, else
    every parameter of the model."""
    if spec is None:
        return model_lib.param_shapes(model_cfg), model_lib.param_logical_axes(model_cfg)
    return (lora_lib.adapter_shapes(model_cfg, spec),
            lora_lib.adapter_logical_axes(model_cfg, spec))


def float_shardings(model_cfg, mesh, rules=DEFAULT_RULES):
    """The full model's NamedShardings (the float base is loaded in them)."""
    return tree_shardings(model_lib.param_logical_axes(model_cfg),
                          model_lib.param_shapes(model_cfg), mesh, rules)


def base_scheme(cfg) -> tuple[str, int]:
    """(scheme, group) the frozen base is held in: ("none", 0), or `lora.base_quantize` with its
    group resolved as decoding resolves --quantize-group."""
    lo = cfg.lora
    return lo.base_quantize, resolve_group(lo.base_quantize, lo.base_quantize_group)


def base_abstract(cfg, model_cfg):
    """The frozen base as ShapeDtypeStructs without shardings: the params in the compute dtype,
    quantized under `base_scheme` (QArrays of int8 / int4 values and compute-dtype scales)."""
    shapes = model_lib.param_shapes(model_cfg, compute_dtype(cfg))
    return quantize.quantize_params(shapes, *base_scheme(cfg))


def base_shardings(cfg, model_cfg, mesh, rules=DEFAULT_RULES):
    """The frozen base's NamedShardings: the model's logical axes, a quantized kernel's values and
    scales both carrying its kernel's (`quantize.logical_axes`)."""
    shapes = base_abstract(cfg, model_cfg)
    axes = quantize.logical_axes(model_lib.param_logical_axes(model_cfg), shapes)
    return tree_shardings(axes, shapes, mesh, rules)


def base_shapes(cfg, model_cfg, mesh, rules=DEFAULT_RULES):
    """The frozen base as sharded ShapeDtypeStructs (the dry run's argument): compute dtype, or
    quantized under `lora.base_quantize`."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        base_abstract(cfg, model_cfg), base_shardings(cfg, model_cfg, mesh, rules))


def initial_adapters(cfg, model_cfg):
    """Fresh adapters from the run's seed (A random, B zero: the step-0 model is the base)."""
    return lora_lib.init_adapters(model_cfg, spec_of(cfg), cfg.seed)


def _leaf_hash(x):
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)   # int4 / int8 exact
    weights = jnp.arange(bits.size, dtype=jnp.uint32).reshape(bits.shape)
    return jnp.sum(bits * (weights * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)


def fingerprint(params) -> str:
    """16 hex digits naming `params` exactly: per weight, a position-weighted sum of its float32
    bits modulo 2^32 (integer sums: the same on every mesh and device count), hashed with the
    tree's paths and shapes. A quantized kernel counts as its values and its scales (paths
    `.qvalue`, `.scale`): a base quantized otherwise, or not, has another fingerprint."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    sums = jax.jit(lambda xs: [_leaf_hash(x) for x in xs])([x for _, x in flat])
    h = hashlib.sha256()
    for (path, x), s in zip(flat, sums):
        h.update(f"{jax.tree_util.keystr(path)}{tuple(x.shape)}{int(s)};".encode())
    return h.hexdigest()[:16]


def check_base(cfg, base_hash: str) -> None:
    """A ResumeError naming both bases when `lora.base_hash` of the config, or of the newest
    complete checkpoint in checkpoint.dir (when resuming), is not `base_hash`."""
    from train import checkpoint as ckpt
    where = cfg.model.folder or "model.config (random from the seed)"
    if cfg.lora.base_hash is not None and cfg.lora.base_hash != base_hash:
        raise ckpt.ResumeError(f"lora.base_hash {cfg.lora.base_hash} is not the hash of the base "
                               f"{where} ({base_hash}); the adapters are for another base")
    c = cfg.checkpoint
    if not (c.dir and c.resume):
        return
    steps = ckpt.complete_steps(c.dir)
    if not steps:
        return
    saved = ckpt.read_config(c.dir, steps[0])
    saved_hash = (saved.get("lora") or {}).get("base_hash")
    if saved_hash is not None and saved_hash != base_hash:
        model = saved.get("model") or {}
        was = model.get("from_hf") or model.get("from_orbax") or "model.config"
        raise ckpt.ResumeError(
            f"checkpoint.dir {c.dir} holds LoRA adapters (step {steps[0]}) trained on the base "
            f"{was} with hash {saved_hash}; this run's base {where} has hash {base_hash}: "
            f"refusing to resume on another base. Use the same base, a new checkpoint.dir, or "
            f"checkpoint.resume=false")


def frozen_base(cfg, model_cfg, mesh, load):
    """(cfg with lora.base_hash set, the base in the compute dtype, quantized under
    `lora.base_quantize`), or (cfg, None) without LoRA: `load(shardings)` gives the float32
    params in their shardings (each buffer freed once cast, each cast kernel once quantized);
    checked by `check_base`."""
    if not cfg.lora.rank:
        return cfg, None
    dtype = compute_dtype(cfg)
    params = load({"params": float_shardings(model_cfg, mesh)})
    base = jax.tree.map(lambda x: x.astype(dtype), params)
    for x in jax.tree.leaves(params):
        if isinstance(x, jax.Array) and x.dtype != dtype and not x.is_deleted():
            x.delete()
    scheme, group = base_scheme(cfg)
    if scheme != "none":
        base = quantize.quantize_params(base, scheme, group, free=True)
        base = jax.device_put(base, base_shardings(cfg, model_cfg, mesh))
        log.info("LoRA's frozen base quantized %s", quantize.describe(scheme, group))
    base_hash = fingerprint(base)
    check_base(cfg, base_hash)
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_hash=base_hash)), base


def forward_variables(params, frozen, dtype):
    """(variables, rngs) of an adapted forward: the base with the adapters beside its kernels in
    the compute dtype; `frozen` is (base, dropout key or None)."""
    base, key = frozen
    rngs = {"dropout": key} if key is not None else None
    return {"params": lora_lib.combine(base, params, dtype)}, rngs


def dropout_key(cfg, step):
    """The step's dropout key (None without dropout): from the seed and the step alone."""
    if not cfg.lora.dropout:
        return None
    return jax.random.fold_in(jax.random.key(cfg.seed + 0x4C6F), step)


def sharding_tree(tree):
    """The NamedShardings of a tree of placed arrays or sharded ShapeDtypeStructs."""
    return jax.tree.map(lambda x: x.sharding, tree,
                        is_leaf=lambda x: isinstance(getattr(x, "sharding", None), NamedSharding))


def export_peft(cfg, model_cfg, adapters, out_dir, force: bool = False) -> str:
    """A LoRA run's adapters as a PEFT folder (wedlm_jax/lora/peft.py) naming its base."""
    from wedlm_jax.lora.peft import save_peft
    host = jax.tree.map(lambda x: jax.device_get(x), adapters)
    out = save_peft(model_cfg, host, spec_of(cfg), out_dir, base=cfg.model.folder, force=force)
    log.info("exported the LoRA adapters (PEFT) to %s", out)
    return out
