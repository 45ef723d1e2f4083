"""The weight quantization schemes' rules, without jax (the option types check them when a
door parses its flags): the schemes, their default group sizes, and the checks of a scheme and
group against a model. The quantizing itself is wedlm_jax/quantize.py."""

from __future__ import annotations

import math

SCHEMES = ("none", "int8", "int4")
DEFAULT_GROUP = {"none": 0, "int8": 0, "int4": 64}   # 0: one scale per output channel


class QuantizeError(ValueError):
    """A quantization setting that cannot work; `field` names it (quantize | quantize_group)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def resolve_group(scheme: str, group: int | None = None) -> int:
    """The group size `scheme` quantizes with (0: per output channel): `group`, else the scheme's
    default. QuantizeError naming the setting for an unknown scheme or a bad group size."""
    if scheme not in SCHEMES:
        raise QuantizeError(f"quantize {scheme!r} is unknown; allowed: {', '.join(SCHEMES)}",
                            "quantize")
    if group is None:
        return DEFAULT_GROUP[scheme]
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise QuantizeError(f"quantize_group must be an int >= 0 (0: per output channel), got "
                            f"{group!r}", "quantize_group")
    if scheme == "none" and group:
        raise QuantizeError(f"quantize_group {group} needs a scheme: quantize int8 or int4",
                            "quantize_group")
    return group


def input_dims(config) -> dict:
    """{projection: the size of its last input axis} (what a group runs along)."""
    e, m = config.hidden_size, config.intermediate_size
    return {"q_proj": e, "k_proj": e, "v_proj": e, "o_proj": config.head_dim,
            "gate_proj": e, "up_proj": e, "down_proj": m}


def check_model(config, scheme: str, group: int | None = None) -> int:
    """The resolved group size, after checking that it tiles every projection's last input axis;
    QuantizeError naming quantize_group and the sizes it must divide otherwise."""
    group = resolve_group(scheme, group)
    if scheme == "none" or not group:
        return group
    dims = input_dims(config)
    bad = [f"{name} ({d})" for name, d in dims.items() if d % group]
    if bad:
        gcd = math.gcd(*dims.values())
        raise QuantizeError(
            f"quantize_group {group} does not divide the input axis of {', '.join(bad)}; "
            f"a group size must divide {gcd} for this model (hidden {config.hidden_size}, "
            f"head_dim {config.head_dim}, intermediate {config.intermediate_size})",
            "quantize_group")
    return group
