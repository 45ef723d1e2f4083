"""Whether a oneOf's branches are disjoint as outlines-core compiles them: its regex is the
branches' union, which enforces oneOf exactly only when nothing one branch produces validates
against another (distinct types, distinct enum values, a required property the other lacks or
whose values cannot match)."""

from __future__ import annotations

from decode.constraints.keywords.instances import none_valid
from decode.constraints.keywords.schema import accepted, admits, deref, dispatch, produced


def excludes(root, a, b, hops: int = 4) -> bool:
    """Whether nothing outlines-core produces for `a` validates against `b`."""
    a, b = deref(root, a), deref(root, b)
    if not isinstance(a, dict) or hops <= 0:
        return False
    if b is False:
        return True
    b_types = accepted(root, b)
    if not any(admits(b_types, t) for t in produced(root, a)):
        return True
    kind = dispatch(a)
    if kind in ("enum", "const"):
        values = a["enum"] if kind == "enum" else [a["const"]]
        return isinstance(values, list) and none_valid(root, b, values)
    if kind == "properties" and isinstance(b, dict) and isinstance(a["properties"], dict):
        return _keys_exclude(root, a, b, hops)
    return False


def _keys_exclude(root, a: dict, b: dict, hops: int) -> bool:
    """Objects of `a` (only its properties, its required ones always) against `b`."""
    props = a["properties"]
    required = [k for k in a.get("required", []) if isinstance(k, str) and k in props]
    b_required = b.get("required", []) if isinstance(b.get("required"), list) else []
    if any(k not in props for k in b_required if isinstance(k, str)):
        return True
    b_props = b.get("properties") if isinstance(b.get("properties"), dict) else {}
    return any(k in b_props and excludes(root, props[k], b_props[k], hops - 1)
               for k in required)


def overlap(root, branches: list) -> tuple[int, int] | None:
    """The first (i, j) whose outputs of i may validate against j."""
    for i, a in enumerate(branches):
        for j, b in enumerate(branches):
            if i != j and not excludes(root, a, b):
                return i, j
    return None
