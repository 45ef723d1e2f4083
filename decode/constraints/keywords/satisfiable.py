"""`unsatisfiable(schema)`: a part of a schema that no instance satisfies (an empty enum or type
list, `not {}`, a const of another type, a lower bound above its upper bound, a required property
that is false or forbidden, an allOf whose branches share no type), found before any decoding so
that such a request is refused rather than decoded into an output that cannot be valid."""

from __future__ import annotations

from decode.constraints.keywords.schema import accepted, declared_types, is_number, is_type, join

_BOUNDS = (("minimum", "maximum", ">"), ("exclusiveMinimum", "exclusiveMaximum", ">="),
           ("minLength", "maxLength", ">"), ("minItems", "maxItems", ">"),
           ("minProperties", "maxProperties", ">"))


def _bounds(node: dict, path: str) -> tuple[str, str] | None:
    for lo, hi, op in _BOUNDS:
        x, y = node.get(lo), node.get(hi)
        if is_number(x) and is_number(y) and (x > y if op == ">" else x >= y):
            return join(path, lo), f"{lo} {x:g} {op} {hi} {y:g}"
    return None


def _empty(root, node: dict, path: str) -> tuple[str, str] | None:
    """A keyword of `node` itself that no instance satisfies."""
    if node.get("enum") == []:
        return join(path, "enum"), "enum is empty"
    if node.get("type") == []:
        return join(path, "type"), "type is an empty list"
    if node.get("not") in ({}, True):
        return join(path, "not"), "not {} forbids every instance"
    types = declared_types(node.get("type"))
    if "const" in node and "type" in node and not is_type(types, node["const"]):
        return (join(path, "const"), f"const {node['const']!r} is not of type "
                f"{' or '.join(sorted(types))}")
    return _bounds(node, path) or _required(node, path) or _all_of_types(root, node, path)


def _required(node: dict, path: str) -> tuple[str, str] | None:
    required = node.get("required") if isinstance(node.get("required"), list) else []
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in required:
        if props.get(name) is False:
            return join(path, "properties", name), f"required property {name!r} is false"
        if (name not in props and node.get("additionalProperties") is False
                and not node.get("patternProperties")):
            return (join(path, "required"), f"required property {name!r} is forbidden by "
                    "additionalProperties false")
    return None


def _all_of_types(root, node: dict, path: str) -> tuple[str, str] | None:
    subs = node.get("allOf")
    if not isinstance(subs, list) or not subs:
        return None
    sets = [accepted(root, s) for s in subs]
    if "type" in node:
        sets.append(accepted(root, {"type": node["type"]}))
    common = set.intersection(*sets)
    if common:
        return None
    named = sorted({t for s in subs if isinstance(s, dict) for t in declared_types(s.get("type"))})
    what = " and ".join(named) if named else "contradictory types"
    return join(path, "allOf"), f"allOf of types {what} has no common type"


def _subschemas(node: dict, path: str):
    """(schema, path) of the schemas directly inside `node`."""
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(node.get(key), dict):
            yield from ((s, join(path, key, k)) for k, s in node[key].items())
    for key in ("allOf", "anyOf", "oneOf", "prefixItems", "items"):
        if isinstance(node.get(key), list):
            yield from ((s, join(path, key, i)) for i, s in enumerate(node[key]))
    for key in ("items", "additionalProperties", "additionalItems", "contains", "not", "if",
                "then", "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems"):
        if isinstance(node.get(key), dict):
            yield node[key], join(path, key)


def unsatisfiable(schema) -> tuple[str, str] | None:
    """(path, reason) of the first part of `schema` that no instance satisfies, or None."""
    if schema is False:
        return "", "the schema is false"
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _empty(schema, node, path)
        if found:
            return found
        stack.extend(reversed(list(_subschemas(node, path))))
    return None
