"""PEFT LoRA folders <-> this project's adapter trees (wedlm_jax/lora/apply.py).

    save_peft(config, adapters, spec, "out/adapter", base="path/or/hub-id")
    spec, adapters = load_peft("out/adapter", config)

A PEFT folder holds `adapter_config.json` (`peft_type` LORA, `r`, `lora_alpha`, `lora_dropout`,
`target_modules`, ...) and `adapter_model.safetensors` with one pair per adapted layer module:
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r]; the module's output gains `(lora_alpha / r) * x A^T B^T`. Ours: A [L, in, r] and
B [L, r, out] of the layers stacked (the kernel's axes flattened in their order, which is HF's
`nn.Linear` order), so lora_A = A[i]^T and lora_B = B[i]^T.

Reading checks before any tensor is used and names what it refuses, in one line: a PEFT type
other than LORA, DoRA (`use_dora`), rsLoRA (`use_rslora`), per-module ranks or alphas
(`rank_pattern`, `alpha_pattern`), trained biases or extra modules (`bias`, `modules_to_save`),
targets this decoder lacks, a rank above the bound, and a tensor whose shape is not the model's
(another base), named with both shapes.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from wedlm_jax.config import ModelConfig
from wedlm_jax.lora.spec import (MAX_RANK, PROJECTIONS, LoraError, LoraSpec, group_of,
                                 projection_sizes)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\."
                  r"lora_([AB])(?:\.default)?\.weight\Z")


def peft_config(spec: LoraSpec, base: str | None) -> dict:
    """adapter_config.json of `spec` (PEFT's LoraConfig fields, defaults where ours has none)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": list(spec.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
            "modules_to_save": None, "layers_to_transform": None, "init_lora_weights": True,
            "inference_mode": True}


def peft_tensors(config: ModelConfig, adapters) -> dict[str, np.ndarray]:
    """{PEFT tensor name: float32 array} of an adapter tree (layers stacked)."""
    out = {}
    for group, mods in adapters["layers"].items():
        for name, ab in mods.items():
            a, b = np.asarray(ab["kernel_lora_a"], np.float32), np.asarray(ab["kernel_lora_b"],
                                                                           np.float32)
            for i in range(config.num_layers):
                stem = f"{PREFIX}model.layers.{i}.{PROJECTIONS[name]}"
                out[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
                out[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return out


def save_peft(config: ModelConfig, adapters, spec: LoraSpec, out_dir, base: str | None = None,
              force: bool = False) -> str:
    """Write the adapters as a PEFT folder at `out_dir` (atomically); `base` is recorded as
    base_model_name_or_path. Returns the folder."""
    from safetensors.numpy import save_file
    from wedlm_jax.checkpoints.folders import atomic_output_dir
    is_peft = lambda d: os.path.isfile(os.path.join(d, CONFIG_FILE))  # noqa: E731
    with atomic_output_dir(out_dir, force, is_complete=is_peft, what="a PEFT adapter") as tmp:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(peft_config(spec, base), f, indent=2)
        save_file(peft_tensors(config, adapters), os.path.join(tmp, WEIGHTS_FILE),
                  metadata={"format": "pt"})
    return os.path.abspath(os.fspath(out_dir))


def read_spec(folder, max_rank: int = MAX_RANK) -> LoraSpec:
    """The LoraSpec of a PEFT folder's adapter_config.json; LoraError naming an option this
    project does not apply."""
    path = os.path.join(os.fspath(folder), CONFIG_FILE)
    if not os.path.isfile(path):
        raise LoraError(f"{folder}: no {CONFIG_FILE}; not a PEFT adapter folder", "lora")
    try:
        with open(path) as f:
            c = json.load(f)
    except ValueError as e:
        raise LoraError(f"{path}: not valid JSON ({e})", "lora") from None
    refused = [("peft_type", c.get("peft_type", "LORA") != "LORA", "only LORA adapters load"),
               ("use_dora", bool(c.get("use_dora")), "DoRA adapters are not supported"),
               ("use_rslora", bool(c.get("use_rslora")), "rsLoRA scaling is not supported"),
               ("rank_pattern", bool(c.get("rank_pattern")), "per-module ranks are not supported"),
               ("alpha_pattern", bool(c.get("alpha_pattern")),
                "per-module alphas are not supported"),
               ("bias", c.get("bias", "none") != "none", "trained biases are not supported"),
               ("modules_to_save", bool(c.get("modules_to_save")),
                "fully trained extra modules are not supported"),
               ("fan_in_fan_out", bool(c.get("fan_in_fan_out")), "only nn.Linear layouts load")]
    for key, bad, why in refused:
        if bad:
            raise LoraError(f"{path}: {key}={c.get(key)!r}: {why}", key)
    rank = c.get("r")
    if isinstance(rank, int) and rank > max_rank:
        raise LoraError(f"{path}: r={rank} is above the rank bound {max_rank}", "r")
    targets = c.get("target_modules") or []
    if isinstance(targets, str):
        targets = list(PROJECTIONS) if targets == "all-linear" else [targets]
    unknown = [t for t in targets if t not in PROJECTIONS]
    if unknown:
        raise LoraError(f"{path}: target_modules {unknown} are not projections of this decoder "
                        f"({', '.join(PROJECTIONS)})", "target_modules")
    return LoraSpec(rank, float(c.get("lora_alpha", 8)), float(c.get("lora_dropout") or 0.0),
                    tuple(targets))


def _expected(config: ModelConfig, name: str, rank: int) -> tuple[tuple, tuple]:
    """(lora_A shape, lora_B shape) of projection `name` at `rank`."""
    fan_in, fan_out = projection_sizes(config)[name]
    return (rank, fan_in), (fan_out, rank)


def load_peft(folder, config: ModelConfig, max_rank: int = MAX_RANK):
    """(LoraSpec, float32 adapter tree) of a PEFT folder for a model of `config`; LoraError
    naming the option, the tensor or the shape that does not fit."""
    from safetensors.numpy import load_file
    spec = read_spec(folder, max_rank)
    path = os.path.join(os.fspath(folder), WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise LoraError(f"{folder}: no {WEIGHTS_FILE} (only safetensors adapters load)", "lora")
    tensors = load_file(path)
    found: dict = {}
    for key, arr in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in spec.targets:
            raise LoraError(f"{path}: tensor {key} is not a LoRA weight of the targets "
                            f"{', '.join(spec.targets)}", key)
        layer, name, side = int(m.group(1)), m.group(3), m.group(4)
        want = _expected(config, name, spec.rank)[0 if side == "A" else 1]
        if layer >= config.num_layers or tuple(arr.shape) != want:
            where = (f"layer {layer} of a {config.num_layers}-layer model"
                     if layer >= config.num_layers else f"shape {tuple(arr.shape)}, the model "
                     f"needs {want}")
            raise LoraError(f"{path}: tensor {key}: {where} (an adapter for another base?)", key)
        found[(layer, name, side)] = arr.astype(np.float32)
    return spec, _stack(found, config, spec, path)


def _stack(found: dict, config: ModelConfig, spec: LoraSpec, path: str):
    tree: dict = {"layers": {}}
    for name in spec.targets:
        for side, leaf in (("A", "kernel_lora_a"), ("B", "kernel_lora_b")):
            missing = [i for i in range(config.num_layers) if (i, name, side) not in found]
            if missing:
                raise LoraError(f"{path}: no lora_{side} of {name} for layer(s) {missing[:8]} "
                                f"(layers_to_transform is not supported)", name)
            stacked = np.stack([found[(i, name, side)].T for i in range(config.num_layers)])
            tree["layers"].setdefault(group_of(name), {}).setdefault(name, {})[leaf] = stacked
    return tree
