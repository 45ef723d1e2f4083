"""The one table that maps logical axis names onto the mesh ('data', 'fsdp', 'tensor'), without
jax (the option types read the mesh's axes when a door parses its flags); the shardings made
from it are wedlm_jax/sharding.py's."""

from __future__ import annotations

import dataclasses
from typing import Any

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """logical axis -> mesh axis (or tuple of axes, or None for replicated)."""
    batch: Any = ("data", "fsdp")
    length: Any = None
    vocab: Any = "tensor"
    embed: Any = "fsdp"
    heads: Any = "tensor"
    kv_heads: Any = "tensor"
    head_dim: Any = None
    mlp: Any = "tensor"
    norm: Any = None
    cache_length: Any = None
    pages: Any = ("data", "fsdp")  # the paged cache's pool: each slot shard's own pages
    layers: Any = None  # the stacked-layer axis of the layer scan: never split (one layer a step)

    def as_flax_rules(self) -> tuple:
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    def mesh_axes(self, logical: str | None):
        if logical is None:
            return None
        if not hasattr(self, logical):
            raise KeyError(f"logical axis {logical!r} has no rule; known: "
                           f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return getattr(self, logical)


DEFAULT_RULES = AxisRules()
