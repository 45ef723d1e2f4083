"""The rules of a LoRA adapter's settings, without jax (the train config's checks and the PEFT
reader use them before anything loads): the projections an adapter may target and their short
names, the bound on the rank, and `LoraSpec`, the checked settings (rank, alpha, dropout,
targets). The adapters themselves are wedlm_jax/lora/apply.py's.

Scale: a target's output gains `(alpha / rank) * x @ A @ B`, PEFT's `lora_alpha / r` (not
rsLoRA's `lora_alpha / sqrt(r)`).
"""

from __future__ import annotations

import dataclasses
import math

# the decoder's projections, each with its PEFT module path under a layer
PROJECTIONS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
               "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
               "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
               "down_proj": "mlp.down_proj"}
SHORT = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
         "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ALL_LINEAR = "all-linear"


def group_of(name: str) -> str:
    """The parameter group under a layer ("attn" or "mlp") holding projection `name`."""
    return "attn" if PROJECTIONS[name].startswith("self_attn") else "mlp"


def projection_sizes(config) -> dict:
    """{projection name: (fan in, fan out)} of a ModelConfig: its kernel's input and output
    axes flattened (PEFT's lora_A is [r, fan in], lora_B [fan out, r])."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv),
            "v_proj": (c.hidden_size, kv), "o_proj": (q, c.hidden_size),
            "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}
MAX_RANK = 1024     # past this an adapter is no longer low-rank for any supported model


class LoraError(ValueError):
    """A LoRA setting or adapter that cannot be used; `field` names the setting or tensor."""

    def __init__(self, message: str, field: str = "lora"):
        super().__init__(message)
        self.field = field


def allowed_targets() -> str:
    return f"{', '.join(SHORT)}, their *_proj names, or {ALL_LINEAR}"


def resolve_targets(targets) -> tuple[str, ...]:
    """The projection names (`PROJECTIONS` order) of `targets`: short names (q, gate), full
    names (q_proj) or "all-linear"; a LoraError naming the allowed values otherwise."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    names = set()
    for t in targets:
        if t == ALL_LINEAR:
            names.update(PROJECTIONS)
        elif t in SHORT or t in PROJECTIONS:
            names.add(SHORT.get(t, t))
        else:
            raise LoraError(f"lora.targets: {t!r} is not a projection; allowed: "
                            f"{allowed_targets()}", "lora.targets")
    if not names:
        raise LoraError(f"lora.targets is empty; allowed: {allowed_targets()}", "lora.targets")
    return tuple(p for p in PROJECTIONS if p in names)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Checked LoRA settings: `rank` in [1, MAX_RANK], `alpha` > 0, `dropout` in [0, 1),
    `targets` projection names (`resolve_targets`)."""
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = tuple(PROJECTIONS)

    def __post_init__(self):
        check_values(self.rank, self.alpha, self.dropout)
        object.__setattr__(self, "targets", resolve_targets(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_values(rank, alpha, dropout, max_rank: int = MAX_RANK) -> None:
    """A LoraError naming the first of rank / alpha / dropout out of its range."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise LoraError(f"lora.rank must be an integer in [1, {max_rank}], got {rank!r}",
                        "lora.rank")
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise LoraError(f"lora.alpha must be a number > 0, got {alpha!r}", "lora.alpha")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise LoraError(f"lora.dropout must be in [0, 1), got {dropout!r}", "lora.dropout")
