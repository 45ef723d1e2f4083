"""Shardings from the one table that maps logical axis names onto the mesh ('data', 'fsdp',
'tensor'): wedlm_jax/axis_rules.py.

Every parameter of `model.Transformer` is created with logical axis names (see `LOGICAL_AXES`
there); activations are constrained with the same names. `AxisRules` says which mesh axes each
logical name is split over. A dimension the mesh axes do not divide is left replicated rather than
rejected, so one table serves every model size (e.g. 2 KV heads on tensor=4).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from wedlm_jax.axis_rules import DEFAULT_RULES, MESH_AXES, AxisRules

def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence | None = None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh with Auto axis types over `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    need = data * fsdp * tensor
    if need != len(devices):
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {need} does not match "
                         f"the {len(devices)} available devices")
    arr = np.asarray(devices).reshape(data, fsdp, tensor)
    return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def spec_for(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
             rules: AxisRules = DEFAULT_RULES) -> P:
    """PartitionSpec for an array of `shape` whose dimensions carry `logical_axes`."""
    out, used = [], set()
    for name, dim in zip(logical_axes, shape):
        axes = rules.mesh_axes(name)
        if axes is None:
            out.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
        size = math.prod(mesh.shape[a] for a in axes)
        if not axes or dim % size:
            out.append(None)
            continue
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else axes)
    return P(*out)


def is_axes(x) -> bool:
    """A leaf of a logical-axes tree: a tuple of axis names (or None)."""
    return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def tree_shardings(logical_tree, shape_tree, mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """Map a tree of logical-axis tuples and a matching tree of shapes to NamedShardings."""
    return jax.tree.map(lambda axes, s: NamedSharding(mesh, spec_for(axes, s.shape, mesh, rules)),
                        logical_tree, shape_tree, is_leaf=is_axes)


# ------------------------------------------------------------------ kernels under a mesh

def shard_rows(local, mesh, q, k, v, *per_row):
    """Run `local(q, k, v, *per_row)` per device under `jax.shard_map` when a mesh with more
    than one device is given: rows over ('data', 'fsdp') when they divide the batch, heads over
    'tensor' when it divides the KV heads; `per_row` (pytrees of arrays [B, ...]) follow the
    rows. Without such a mesh, `local` runs as is."""
    if mesh is None or all(n == 1 for n in mesh.shape.values()):
        return local(q, k, v, *per_row)
    batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    n_batch = int(np.prod([mesh.shape[a] for a in batch_axes])) if batch_axes else 1
    if q.shape[0] % n_batch:
        batch_axes = ()
    tensor = mesh.shape.get("tensor", 1)
    head_axis = "tensor" if tensor > 1 and k.shape[2] % tensor == 0 else None
    bspec = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None
    qkv = P(bspec, None, head_axis, None)
    specs = jax.tree.map(lambda a: P(bspec, *([None] * (a.ndim - 1))), per_row)
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv) + tuple(specs),
                         out_specs=qkv, check_vma=False)(q, k, v, *per_row)


def current_mesh(mesh=None):
    """`mesh`, else the mesh set by `jax.set_mesh` (None when none is)."""
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract
