"""The training configuration: frozen dataclasses, read from YAML with `key=value` overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["optimizer.lr=1e-3", "steps=10"])

Every key is checked against the dataclass fields; an unknown key raises `TrainConfigError` naming
the nearest valid key. Values are validated on loading (train/checks.py: block size, loss weights,
schedule, mesh shape), so a bad config stops the program before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Mapping, Sequence

import yaml

from train.checks import CHECKS, COMPUTE_DTYPES
from wedlm_jax.dtypes import jnp_dtype

REMAT_ALIASES = {True: "full", False: "none"}  # the old boolean switch


class TrainConfigError(ValueError):
    """A training config (file, override or value) that cannot be honoured."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Where the weights come from: `from_hf` (a Hugging Face folder, the adaptation case),
    `from_orbax` (an Orbax folder written by `wedlm-convert hf-to-orbax`), or an inline
    architecture (`config`, the fields of `wedlm_jax.config.ModelConfig`) for from-scratch."""
    from_hf: str | None = None
    from_orbax: str | None = None
    config: dict | None = None

    @property
    def folder(self) -> str | None:
        """The checkpoint folder the weights (and config.json) come from, if any."""
        return self.from_hf or self.from_orbax


@dataclasses.dataclass(frozen=True)
class DataSection:
    train_files: tuple = ()
    packed_dir: str | None = None  # a folder of `python -m train.data.pretokenize` (instead of train_files)
    tokenizer: str | None = None  # folder with tokenizer.json (default: model.from_hf / from_orbax)
    seq_len: int = 1024  # packed row length (the memory stream; the network sees 2x for dual_stream)
    global_batch_size: int = 8  # rows per optimizer step, over all hosts and microbatches
    shuffle_seed: int = 0
    skip_bad_lines: bool = False
    append_eos: bool = True  # end every pretraining document with the EOS token


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    kind: str = "dual_stream"
    block_size: int = 32
    mask_per_block: bool = True
    ar_weight: float = 1.0
    eps: float = 1e-3  # lower clamp of the masking ratio
    mask_token_id: int | None = None  # default: the model config's, then the tokenizer's mask token


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    lr: float = 3e-6
    final_lr: float = 3e-7
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0  # global-norm clip; 0 disables
    grad_accum: int = 1
    decay_embeddings: bool = True  # weight decay on the embedding / LM head matrices (as HF Trainer)
    mu_dtype: str | None = None  # Adam's first moment: null = the params' dtype, or bf16 (half its
                                 # memory, as MaxText's mu_dtype; the second moment stays f32)


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int = -1  # -1: whatever the device count leaves after fsdp x tensor
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    dir: str | None = None
    every: int = 1000
    keep: int = 3
    async_save: bool = True
    resume: bool = True
    export_hf: str | None = None  # write the final params here in Hugging Face format
    export_force: bool = False  # replace an existing checkpoint at export_hf (wedlm-train --force)


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """Low-rank adapters (train/lora.py): rank 0 trains every weight; rank > 0 freezes the base
    (held in compute_dtype, or quantized: `base_quantize`) and trains adapters on `targets` (q, k,
    v, o, gate, up, down, their *_proj names, or all-linear), scaled by alpha / rank, with dropout
    on their input."""
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple = ("all-linear",)
    base_quantize: str = "none"  # none | int8 | int4: the frozen base quantized as decoding's
                                 # --quantize does (QLoRA; wedlm_jax/quantize.py)
    base_quantize_group: int | None = None  # decoding's --quantize-group: 0 per output channel,
                                            # null the scheme's default (int4: 64, int8: 0)
    base_hash: str | None = None  # the frozen base's fingerprint: written into each checkpoint's
                                  # config by the run; given, a run on another base is refused


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    objective: ObjectiveSection = ObjectiveSection()
    optimizer: OptimizerSection = OptimizerSection()
    mesh: MeshSection = MeshSection()
    checkpoint: CheckpointSection = CheckpointSection()
    lora: LoraSection = LoraSection()
    steps: int = 1000
    seed: int = 0
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: str = "none"  # full | save_dots | none (true / false: full / none)
    attention: str = "auto"  # dense | tiled | splash | cudnn | pallas | auto (attention.backends)
    attention_tile: int = 128  # tile size of the tiled / splash paths
    loss_chunk: int = 0  # > 0: the loss forms logits this many slots at a time (divides seq_len);
                         # 0: full logits [rows, slots, vocab] (wedlm_jax.losses.chunked_loss_terms)
    log_every: int = 1
    time_limit_s: float | None = None  # stop at the first log step past this many seconds of
                                       # training (compile excluded): saved and exported as at the end
    nonfinite_skips: int = 0  # updates with a non-finite loss or gradient norm skipped before the
                              # run stops at one (0: stop at the first; train/loop.py)
    metrics_file: str | None = None  # JSONL; default <checkpoint.dir>/metrics.jsonl when that is set
    peak_flops: float | None = None  # per-device FLOP/s for MFU (given: "mfu" is logged)
    log_mfu: bool = False  # log "mfu" per step; without peak_flops, measures the f32 matmul rate first
    progress: bool = True
    distributed: bool = False  # call jax.distributed.initialize (also when the env asks for it)

    @property
    def warmup(self) -> int:
        o = self.optimizer
        if o.warmup_steps is not None:
            return int(o.warmup_steps)
        if o.warmup_ratio is not None:
            return int(round(o.warmup_ratio * self.steps))
        return 0

    def to_dict(self) -> dict:
        return _to_plain(dataclasses.asdict(self))


SECTIONS = {"model": ModelSection, "data": DataSection, "objective": ObjectiveSection,
            "optimizer": OptimizerSection, "mesh": MeshSection, "checkpoint": CheckpointSection,
            "lora": LoraSection}


def _to_plain(x):
    if isinstance(x, dict):
        return {k: _to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_plain(v) for v in x]
    return x


def _all_keys() -> list[str]:
    keys = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in SECTIONS:
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(SECTIONS[f.name])]
        else:
            keys.append(f.name)
    return keys


def _unknown(key: str, where: str) -> TrainConfigError:
    valid = _all_keys()
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    if "." not in key:  # also compare against bare field names
        bare = {k.split(".")[-1]: k for k in valid}
        m = difflib.get_close_matches(key, list(bare), n=1, cutoff=0.6)
        if m:
            near = [bare[m[0]]]
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return TrainConfigError(f"{where}: unknown config key {key!r}{hint}")


def _coerce(value: Any, tp, key: str, where: str):
    """Coerce a YAML / override value to the field's declared type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args or tp is Any:
            return None
        raise TrainConfigError(f"{where}: {key} may not be null")
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise TrainConfigError(f"{where}: {key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise TrainConfigError(f"{where}: {key} must be an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise TrainConfigError(f"{where}: {key} must be an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TrainConfigError(f"{where}: {key} must be a number, got {value!r}") from None
    if tp is str:
        return str(value)
    if tp is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise TrainConfigError(f"{where}: {key} must be a list, got {value!r}")
        return tuple(value)
    if tp is dict:
        if not isinstance(value, Mapping):
            raise TrainConfigError(f"{where}: {key} must be a mapping, got {value!r}")
        return dict(value)
    return value


def _build(cls, raw: Mapping, prefix: str, where: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in raw.items():
        full = f"{prefix}{k}"
        if k not in names:
            raise _unknown(full, where)
        if k in SECTIONS and cls is TrainConfig:
            if not isinstance(v, Mapping):
                raise TrainConfigError(f"{where}: {full} must be a mapping of keys, got {v!r}")
            kw[k] = _build(SECTIONS[k], v, f"{k}.", where)
        elif cls is TrainConfig and k == "remat" and isinstance(v, bool):
            kw[k] = REMAT_ALIASES[v]
        else:
            kw[k] = _coerce(v, hints[k], full, where)
    return cls(**kw)


def _set_path(d: dict, dotted: str, value, where: str):
    parts = dotted.split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise TrainConfigError(f"{where}: cannot set {dotted!r}: {p!r} is not a section")
        cur = nxt
    cur[parts[-1]] = value


def parse_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Apply `section.key=value` overrides (values parsed as YAML scalars) to a raw config dict."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        if "=" not in item:
            raise TrainConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        value = yaml.safe_load(text) if text else None
        _set_path(raw, key, value, f"override {item!r}")
    return raw


def load_config(path: str | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config file (or start from the defaults when `path` is None), apply overrides,
    validate and return the frozen config."""
    raw: dict = {}
    where = path or "<defaults>"
    if path is not None:
        if not os.path.exists(path):
            raise TrainConfigError(f"config file {path} does not exist")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise TrainConfigError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(raw, dict):
            raise TrainConfigError(f"{path}: the top level must be a mapping of keys")
    # Overrides are checked key by key first so the error names the override, not the file.
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        _check_key(key, f"override {item!r}")
        _check_override_value(item)
    try:
        return config_from_dict(parse_overrides(raw, overrides), where)
    except TrainConfigError as e:
        blamed = blamed_overrides(str(e)[len(where) + 2:], raw, overrides, where)
        if not blamed:
            raise
        raise TrainConfigError(f"override {', '.join(map(repr, blamed))}: "
                               f"{str(e)[len(where) + 2:]}") from None


def blamed_overrides(message: str, raw: dict, overrides: Sequence[str], where: str) -> list[str]:
    """The overrides a validation error of the overridden config is about: those whose key the
    message names, when the file alone is valid (else the file is to blame: [])."""
    if not overrides or not message:
        return []
    try:
        config_from_dict(raw, where)
    except TrainConfigError:
        return []
    keys = [(item, item.split("=", 1)[0].strip()) for item in overrides]
    return [item for item, key in keys if re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message)]


def config_from_dict(raw: Mapping, where: str = "<dict>") -> TrainConfig:
    """The validated config of a raw (YAML-shaped) mapping; errors name `where` and the key."""
    cfg = _build(TrainConfig, raw, "", where)
    validate(cfg, where)
    return cfg


def _check_key(key: str, where: str):
    parts = key.split(".")
    if parts[0] in SECTIONS:
        if len(parts) == 1:
            raise TrainConfigError(f"{where}: {key!r} is a section; set one of its keys")
        if parts[0] == "model" and parts[1] == "config" and len(parts) >= 2:
            return
        if len(parts) != 2 or parts[1] not in {f.name for f in dataclasses.fields(SECTIONS[parts[0]])}:
            raise _unknown(key, where)
    elif len(parts) != 1 or parts[0] not in {f.name for f in dataclasses.fields(TrainConfig)}:
        raise _unknown(key, where)


def _check_override_value(item: str) -> None:
    """An override's value against its field's type, so a bad value is blamed on the override."""
    if "=" not in item:
        return
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if parts[0] in SECTIONS and len(parts) == 2:
        hints = typing.get_type_hints(SECTIONS[parts[0]])
    elif len(parts) == 1 and parts[0] not in SECTIONS:
        hints = typing.get_type_hints(TrainConfig)
    else:
        return
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        raise TrainConfigError(f"override {item!r}: the value is not valid YAML") from None
    _coerce(value, hints[parts[-1]], key.strip(), f"override {item!r}")


def validate(cfg: TrainConfig, where: str = "config") -> None:
    """Every value check that needs no device, no files and no compilation (train.checks)."""
    def bad(key, msg):
        raise TrainConfigError(f"{where}: {key} {msg}")

    for check in CHECKS:
        check(cfg, bad)


def mesh_shape(cfg: TrainConfig, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) for `num_devices`, resolving data=-1; errors if the mesh does not divide
    the device count or the batch."""
    m = cfg.mesh
    inner = m.fsdp * m.tensor
    if m.data == -1:
        if num_devices % inner:
            raise TrainConfigError(f"mesh.fsdp x mesh.tensor = {inner} does not divide the "
                                   f"{num_devices} devices")
        data = num_devices // inner
    else:
        data = m.data
    if data * inner != num_devices:
        raise TrainConfigError(f"mesh data={data} x fsdp={m.fsdp} x tensor={m.tensor} = "
                               f"{data * inner} does not match the {num_devices} devices")
    micro = cfg.data.global_batch_size // cfg.optimizer.grad_accum
    if micro % (data * m.fsdp):
        raise TrainConfigError(
            f"the microbatch (data.global_batch_size {cfg.data.global_batch_size} / "
            f"optimizer.grad_accum {cfg.optimizer.grad_accum} = {micro} rows) is not divisible by "
            f"the batch-sharding mesh axes data x fsdp = {data * m.fsdp}")
    return data, m.fsdp, m.tensor


def compute_dtype(cfg: TrainConfig):
    return jnp_dtype(cfg.compute_dtype, COMPUTE_DTYPES, "compute_dtype")


def model_config(cfg: TrainConfig):
    """The `ModelConfig` (read from the HF folder or built from the inline fields), with the
    objective's mask_token_id applied when given."""
    from wedlm_jax.config import ConfigError, ModelConfig
    if cfg.model.from_orbax is not None:
        from wedlm_jax.checkpoints import read_config
        mc = read_config(cfg.model.from_orbax)
    elif cfg.model.from_hf is not None:
        mc = ModelConfig.from_hf(cfg.model.from_hf)
        if mc.model_type == "wedlm":  # the released checkpoints' conventions (README)
            from wedlm_jax.config import settle_qk_norm
            from wedlm_jax.safetensors_io import index_tensors
            mc = settle_qk_norm(mc, cfg.model.from_hf, index_tensors(cfg.model.from_hf))
    else:
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        for k in cfg.model.config:
            if k not in names:
                near = difflib.get_close_matches(k, sorted(names), n=1, cutoff=0.0)
                raise TrainConfigError(f"model.config: unknown field {k!r}; did you mean "
                                       f"'model.config.{near[0]}'?")
        fields = dict(cfg.model.config)
        if isinstance(fields.get("eos_token_id"), list):
            fields["eos_token_id"] = tuple(fields["eos_token_id"])
        try:
            mc = ModelConfig(**fields)
        except TypeError as e:
            raise TrainConfigError(f"model.config: {e}") from None
        except ConfigError as e:
            raise TrainConfigError(f"model.config: {e}") from None
    if cfg.objective.mask_token_id is not None:
        if not 0 <= cfg.objective.mask_token_id < mc.vocab_size:
            raise TrainConfigError(f"objective.mask_token_id {cfg.objective.mask_token_id} is outside "
                                   f"the vocabulary [0, {mc.vocab_size})")
        mc = mc.replace(mask_token_id=cfg.objective.mask_token_id)
    check_base_quantize(cfg, mc)
    return mc


def check_base_quantize(cfg: TrainConfig, mc) -> None:
    """A TrainConfigError naming lora.base_quantize_group when its group does not tile every
    projection's input axis of the model `mc` (wedlm_jax.quantize_scheme.check_model)."""
    from wedlm_jax.quantize_scheme import QuantizeError, check_model
    try:
        check_model(mc, cfg.lora.base_quantize, cfg.lora.base_quantize_group)
    except QuantizeError as e:
        raise TrainConfigError(f"lora.base_{e}") from None
