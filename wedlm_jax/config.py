"""Model configuration: one frozen dataclass, read from and written to a Hugging Face `config.json`.

Supported `model_type`s: qwen2 (Qwen2 / Qwen2.5: q/k/v bias), qwen3 (per-head q/k RMSNorm, explicit
`head_dim`), llama, and wedlm (the released WeDLM checkpoints: explicit `attention_bias`, `qk_norm`
and `mask_token_id`). Nothing here knows about diffusion except `mask_token_id`.

The released WeDLM checkpoints' conventions (README "Released checkpoints"): `released_mask_token_id`
(a `wedlm` config with `mask_token_id: null` means 151665) and `settle_qk_norm` (`qk_norm` left out
is decided by the checkpoint's q/k-norm tensors; a stated one must agree with them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "wedlm")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigError(ValueError):
    """A config.json (or a field of it) this project cannot honour."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # RoPE scaling as sorted (key, value) pairs so the dataclass stays hashable; see `rope_params`.
    rope_scaling: tuple = (("rope_type", "default"),)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"config field {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        rope_type = self.rope_params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"RoPE type {rope_type!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                              f"[0, {self.vocab_size})")

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        e, h = self.hidden_size, self.head_dim
        attn = e * (self.q_dim + 2 * self.kv_dim) + self.q_dim * e
        attn += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + e * self.o_bias + 2 * h * self.qk_norm
        mlp = 3 * e * self.intermediate_size + (2 * self.intermediate_size + e) * self.mlp_bias
        per_layer = attn + mlp + 2 * e
        head = 0 if self.tie_word_embeddings else e * self.vocab_size
        return self.vocab_size * e + self.num_layers * per_layer + e + head

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported; supported: silu")
        if d.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported (full attention only)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ConfigError(f"{source}: missing required field {key!r}")
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        theta, scaling = _read_rope(d, source)
        attention_bias = bool(d.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias, qk_norm = True, False, False
        elif model_type == "qwen3":
            qkv_bias, o_bias, qk_norm = attention_bias, attention_bias, True
        elif model_type == "llama":
            qkv_bias, o_bias, qk_norm = attention_bias, attention_bias, False
        else:  # wedlm: explicit flags; the bias, as in Qwen2, is on q/k/v only.
            qkv_bias, o_bias, qk_norm = attention_bias, False, bool(d.get("qk_norm", False))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(eos)
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=qk_norm,
            mask_token_id=d.get("mask_token_id"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `config.json` from a checkpoint folder (or the file itself)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"{path}: no config.json")
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=path)

    def to_hf_dict(self) -> dict:
        """A config.json that transformers (>= 5) loads for this architecture."""
        rope = dict(self.rope_params)
        rope["rope_theta"] = self.rope_theta
        d = {
            "model_type": self.model_type,
            "architectures": [_ARCHITECTURES[self.model_type]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.model_type == "qwen2":
            d["use_sliding_window"] = False
        if self.model_type == "wedlm":
            d["attention_bias"] = self.qkv_bias
            d["qk_norm"] = self.qk_norm
        for key in ("mask_token_id", "bos_token_id", "pad_token_id"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.eos_token_id is not None:
            d["eos_token_id"] = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) \
                else self.eos_token_id
        return d


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "llama": "LlamaForCausalLM", "wedlm": "WeDLMForCausalLM"}


def _read_rope(d: Mapping[str, Any], source: str) -> tuple[float, tuple]:
    """RoPE theta and scaling from either the transformers-5 `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling`."""
    merged = resolve_rope_keys(d, source)
    theta = merged.pop("rope_theta")
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: RoPE type {rope_type!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type != "default" and "factor" not in merged:
        raise ConfigError(f"{source}: RoPE type {rope_type!r} needs a 'factor'")
    merged["rope_type"] = rope_type
    if "original_max_position_embeddings" not in merged and rope_type in ("llama3", "yarn"):
        omax = d.get("original_max_position_embeddings")
        if omax is not None:
            merged["original_max_position_embeddings"] = omax
    return float(theta), tuple(sorted((k, _freeze(v)) for k, v in merged.items()))


def resolve_rope_keys(d: Mapping[str, Any], source: str = "config.json") -> dict:
    """The one RoPE dict (with `rope_theta`) that transformers (>= 5) builds from a config.json:
    a non-empty `rope_scaling` replaces `rope_parameters` whole (not key by key), and `rope_theta`
    comes from that dict, else the top-level `rope_theta`, else 10000 (`convert_rope_params_to_dict`
    in transformers' modeling_rope_utils). When both keys are set, a `rope_theta` in
    `rope_parameters` that transformers would silently drop for another value is refused; other
    keys of `rope_parameters` that rope_scaling overrides are reported with a warning."""
    params, legacy = d.get("rope_parameters") or {}, d.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: {key} must be a JSON object, got {value!r}")
    chosen = dict(legacy) if legacy else dict(params)
    theta = chosen.get("rope_theta", d.get("rope_theta", 10000.0))
    if legacy and params:
        if "rope_theta" in params and float(params["rope_theta"]) != float(theta):
            origin = ("rope_scaling" if "rope_theta" in legacy else
                      "the top-level rope_theta" if "rope_theta" in d else "the default")
            raise ConfigError(
                f"{source}: rope_parameters and rope_scaling are both set and contradict: "
                f"transformers uses rope_scaling alone, which gives rope_theta {theta} (from "
                f"{origin}), while rope_parameters says rope_theta {params['rope_theta']}. Keep "
                f"one of them: move every RoPE setting (rope_type, factor, rope_theta, ...) into "
                f"rope_parameters and delete rope_scaling")
        ignored = sorted(k for k, v in params.items() if k != "rope_theta" and chosen.get(k) != v)
        if ignored:
            import warnings
            warnings.warn(f"{source}: both rope_parameters and rope_scaling are set; as in "
                          f"transformers, rope_scaling is used whole and rope_parameters' "
                          f"{', '.join(ignored)} ignored", stacklevel=3)
    chosen["rope_theta"] = theta
    return chosen


def _freeze(v):
    return tuple(v) if isinstance(v, list) else v


# --------------------------------------------------------------------------- released WeDLM checkpoints

# The [MASK] id of the released WeDLM checkpoints: their configs say `mask_token_id: null`, and the
# official engine (`wedlm/engine/model_runner.py`) and trainer then use this id.
RELEASED_MASK_TOKEN_ID = 151665
_QK_NORM_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight\Z")


def released_mask_token_id(config: ModelConfig, source: str = "config.json",
                           how: str = "wedlm-decode --mask-token-id ID") -> int | None:
    """The [MASK] id a `wedlm` config with `mask_token_id: null` decodes with: 151665, the id the
    official engine and trainer use, when the vocabulary holds it, else a ConfigError asking for an
    explicit id. None for a config that states its own id or is not a `wedlm` one."""
    if config.model_type != "wedlm" or config.mask_token_id is not None:
        return None
    if config.vocab_size <= RELEASED_MASK_TOKEN_ID:
        raise ConfigError(
            f"{source}: mask_token_id is null, and the vocabulary (vocab_size {config.vocab_size}) does "
            f"not hold {RELEASED_MASK_TOKEN_ID}, the [MASK] id of the released WeDLM checkpoints; "
            f"give the mask token id ({how})")
    return RELEASED_MASK_TOKEN_ID


def settle_qk_norm(config: ModelConfig, folder: str | os.PathLike, tensor_names) -> ModelConfig:
    """A `wedlm` config's `qk_norm` settled against the checkpoint's tensors (names from the
    safetensors headers): absent from `folder/config.json`, it is decided by whether the q/k-norm
    weights (`model.layers.N.self_attn.{q,k}_norm.weight`) are present; stated, it must agree
    with them, else a ConfigError names the field and the tensors. (The released WeDLM-8B has
    `attention_bias: false` and q/k-norm weights; WeDLM-7B has `attention_bias: true`, `qk_norm:
    false` and none. The official engine applies q/k-norm exactly when `attention_bias` is false.)
    Other model types are returned unchanged."""
    if config.model_type != "wedlm":
        return config
    path = os.path.join(os.fspath(folder), "config.json")
    with open(path) as f:
        stated = json.load(f).get("qk_norm")
    norms = sorted(n for n in tensor_names if _QK_NORM_TENSOR.match(n))
    if stated is None:
        return config.replace(qk_norm=bool(norms))
    if stated and not norms:
        raise ConfigError(
            f"{path}: qk_norm is true, but the checkpoint has no q/k-norm tensors "
            f"(model.layers.N.self_attn.q_norm.weight / k_norm.weight); set qk_norm to false, or "
            f"remove the field to let the tensors decide")
    if not stated and norms:
        shown = ", ".join(norms[:4]) + (f" ... ({len(norms)} in all)" if len(norms) > 4 else "")
        raise ConfigError(
            f"{path}: qk_norm is false, but the checkpoint holds q/k-norm tensors ({shown}); set "
            f"qk_norm to true, or remove the field to let the tensors decide (the official engine "
            f"applies q/k-norm whenever attention_bias is false)")
    return config
