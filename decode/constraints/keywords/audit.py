"""The per-position whitelist walk behind `unsupported(schema)`: each schema object is read as
outlines-core compiles it (by the first of `properties`, `allOf`, `anyOf`, `oneOf`,
`prefixItems`, `enum`, `const`, `$ref`, `type` it holds), and every keyword beside that one which
could restrict the value and is not known exact is a finding at its dotted path."""

from __future__ import annotations

import dataclasses

from decode.constraints.keywords.instances import all_valid
from decode.constraints.keywords.overlap import overlap
from decode.constraints.keywords.patterns import plain_char, safe_pattern
from decode.constraints.keywords.schema import (EXACT_FORMATS, FAMILY, JSON_TYPES,
                                                KEYWORD_TYPES, MAX_REF_DEPTH, NOT_ENFORCED,
                                                admits, declared_types, dispatch, fits, is_count,
                                                join, loose_format, produced, ref_target,
                                                restricting)


@dataclasses.dataclass
class _Audit:
    root: object
    memo: dict = dataclasses.field(default_factory=dict)


def _finding(path, key, reason=NOT_ENFORCED) -> list:
    return [(join(path, key), reason)]


def _node(a: _Audit, node, path: str, depth: int) -> tuple[list, bool]:
    """(findings, dropped) of one schema position; dropped: outlines-core gives up on it here
    (the $ref depth limit), which drops the nearest enclosing property."""
    key = (path, depth, id(node))
    if key not in a.memo:
        a.memo[key] = ([], False)              # a cycle without a $ref: found where it starts
        a.memo[key] = _compile(a, node, path, depth)
    return a.memo[key]


def _compile(a: _Audit, node, path: str, depth: int) -> tuple[list, bool]:
    if not isinstance(node, dict):
        return [(path, "a boolean schema is " + NOT_ENFORCED)], False
    if not node:
        return [], False
    kind = dispatch(node)
    if kind is None:
        return [(path, "a schema without type, properties or a combinator is "
                 + NOT_ENFORCED)], False
    if kind == "type":
        return _typed(a, node, path, depth)
    return {"properties": _properties, "allOf": _all_of, "anyOf": _any_of, "oneOf": _one_of,
            "prefixItems": _prefix_items, "enum": _enum, "const": _enum,
            "$ref": _ref}[kind](a, node, path, depth)


def _children(a: _Audit, pairs, depth: int) -> tuple[list, bool]:
    findings, dropped = [], False
    for sub, path in pairs:
        more, gone = _node(a, sub, path, depth)
        findings += more
        dropped |= gone
    return findings, dropped


def _siblings(a: _Audit, node: dict, path: str, kind: str, fine=()) -> list:
    """Findings of the keywords beside `kind` that outlines-core drops: fine when they cannot
    restrict what it produces (`fine`: those this position satisfies anyway)."""
    made = produced(a.root, node)
    out = []
    for key in restricting(node):
        if key == kind or key in fine:
            continue
        if key == "type" and fits(declared_types(node["type"]), made):
            continue
        fam = KEYWORD_TYPES.get(key)
        if fam and not any(admits({fam}, t) if fam == "number" else t == fam
                           for t in made):
            continue
        out += _finding(path, key)
    return out


def _properties(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    props = node["properties"]
    if not isinstance(props, dict):
        return _finding(path, "properties"), False
    required = node.get("required", [])
    required = required if isinstance(required, list) else []
    fine = ["additionalProperties", "unevaluatedProperties"]
    out = []
    missing = [r for r in required if r not in props]
    if missing:
        out += _finding(path, "required", f"required property {missing[0]!r} is not in "
                      "properties: " + NOT_ENFORCED)
    fine.append("required")
    n_req = len([r for r in props if r in required])
    if is_count(node.get("minProperties")) and node["minProperties"] <= n_req:
        fine.append("minProperties")
    if is_count(node.get("maxProperties")) and node["maxProperties"] >= len(props):
        fine.append("maxProperties")
    out += _siblings(a, node, path, "properties", fine)
    for name, sub in props.items():
        p = join(path, "properties", name)
        if not all(plain_char(ch) for ch in name):
            out.append((p, "a property name needing a JSON escape is " + NOT_ENFORCED))
            continue
        more, dropped = _node(a, sub, p, depth)
        if dropped and name in required:
            out.append((p, f"a required $ref nested deeper than {MAX_REF_DEPTH} is "
                        + NOT_ENFORCED))
        elif not dropped:
            out += more
    return out, False


def _all_of(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    subs = node["allOf"]
    if not isinstance(subs, list) or len(subs) != 1:
        return _finding(path, "allOf", "allOf of more than one schema is " + NOT_ENFORCED), False
    out, dropped = _children(a, [(subs[0], join(path, "allOf", 0))], depth)
    return _siblings(a, node, path, "allOf") + out, dropped


def _any_of(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    subs = node["anyOf"]
    if not isinstance(subs, list) or not subs:
        return _finding(path, "anyOf"), False
    out, dropped = _children(a, [(s, join(path, "anyOf", i)) for i, s in enumerate(subs)],
                             depth)
    return _siblings(a, node, path, "anyOf") + out, dropped


def _one_of(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    subs = node["oneOf"]
    if not isinstance(subs, list) or not subs:
        return _finding(path, "oneOf"), False
    out = _siblings(a, node, path, "oneOf")
    if overlap(a.root, subs):
        out += _finding(path, "oneOf", "oneOf with overlapping branches")
    more, dropped = _children(a, [(s, join(path, "oneOf", i)) for i, s in enumerate(subs)],
                              depth)
    return out + more, dropped


def _prefix_items(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    subs = node["prefixItems"]
    if not isinstance(subs, list):
        return _finding(path, "prefixItems"), False
    fine = ["items", "additionalItems", "unevaluatedItems"]
    if is_count(node.get("minItems")) and node["minItems"] <= len(subs):
        fine.append("minItems")
    if is_count(node.get("maxItems")) and node["maxItems"] >= len(subs):
        fine.append("maxItems")
    if node.get("uniqueItems") is False or len(subs) <= 1:
        fine.append("uniqueItems")
    out, dropped = _children(
        a, [(s, join(path, "prefixItems", i)) for i, s in enumerate(subs)], depth)
    return _siblings(a, node, path, "prefixItems", fine) + out, dropped


def _enum(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    kind = "enum" if "enum" in node else "const"
    values = node[kind] if kind == "enum" else [node[kind]]
    if not isinstance(values, list):
        return _finding(path, kind), False
    if any(isinstance(v, (dict, list)) for v in values):
        return _finding(path, kind, f"{kind} of objects or arrays is " + NOT_ENFORCED), False
    if not all_valid(a.root, node, values):
        return _finding(path, kind, f"{kind} with values the schema's other keywords forbid"), False
    fine = [k for k in restricting(node) if k != kind]
    return _siblings(a, node, path, kind, fine), False


def _ref(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    out = _siblings(a, node, path, "$ref", ["$ref"])
    if depth > MAX_REF_DEPTH:
        return out, True
    target = ref_target(a.root, node["$ref"])
    if target is None:
        return out + _finding(path, "$ref", "a $ref outside the schema is " + NOT_ENFORCED), False
    more, dropped = _node(a, target[1], target[0], depth + 1)
    return out + more, dropped


def _typed(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    types = node["type"]
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if not names or not all(t in JSON_TYPES for t in names):
        return _finding(path, "type"), False
    out, dropped = [], False
    for key in restricting(node):
        fam = KEYWORD_TYPES.get(key)
        if key != "type" and not fam:
            out += _finding(path, key)
    if "string" in names:
        out += _string(node, path)
    if "number" in names or "integer" in names:
        out += [(join(path, k), NOT_ENFORCED) for k in FAMILY["number"] if k in node]
    if "array" in names:
        more, dropped = _array(a, node, path, depth)
        out += more
    if "object" in names:
        more, gone = _object(a, node, path, depth)
        out, dropped = out + more, dropped or gone
    return out, dropped


def _string(node: dict, path: str) -> list:
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    out = [(join(path, k), NOT_ENFORCED) for k in lengths if not is_count(node[k])]
    if lengths:
        rest = ["pattern"] + ([] if loose_format(node) else ["format"])
        return out + [(join(path, k), NOT_ENFORCED) for k in rest if k in node]
    if "pattern" in node:
        p = node["pattern"]
        out = [] if isinstance(p, str) and safe_pattern(p) else _finding(
            path, "pattern", "a pattern outside the exact regex subset is " + NOT_ENFORCED)
        if isinstance(p, str) and "format" in node and not loose_format(node):
            out += _finding(path, "format")
        return out
    if "format" in node and node["format"] not in EXACT_FORMATS:
        return _finding(path, "format", f"format {node['format']!r} is " + NOT_ENFORCED)
    return []


def _array(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    out = [(join(path, k), NOT_ENFORCED) for k in ("minItems", "maxItems")
           if k in node and not is_count(node[k])]
    unique_fine = node.get("uniqueItems") is False or (
        is_count(node.get("maxItems")) and node["maxItems"] <= 1)
    for key in ("contains", "minContains", "maxContains", "uniqueItems", "unevaluatedItems"):
        if key in node and not (key == "uniqueItems" and unique_fine) and not (
                key == "unevaluatedItems" and "items" in node):
            out += _finding(path, key)
    if "items" not in node or node.get("maxItems") == 0:
        return out, False
    if isinstance(node["items"], list):
        return out + _finding(path, "items", "items as a list is " + NOT_ENFORCED), False
    more, dropped = _node(a, node["items"], join(path, "items"), depth)
    return out + more, dropped


def _object(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    out = [(join(path, k), NOT_ENFORCED) for k in ("minProperties", "maxProperties")
           if k in node and not is_count(node[k])]
    if is_count(node.get("minProperties")) and node["minProperties"] > 1:
        out += _finding(path, "minProperties", "minProperties above 1 (keys may repeat) is "
                      + NOT_ENFORCED)
    if is_count(node.get("maxProperties")) and node["maxProperties"] > 0:
        out += _finding(path, "maxProperties", "maxProperties above 0 is " + NOT_ENFORCED)
    for key in ("patternProperties", "dependentRequired", "dependentSchemas", "dependencies",
                "propertyNames", "unevaluatedProperties"):
        if key in node:
            out += _finding(path, key)
    if node.get("required"):
        out += _finding(path, "required", "required without properties is " + NOT_ENFORCED)
    if node.get("maxProperties") == 0:
        return out, False
    extra = node.get("additionalProperties", True)
    if extra is True:
        return out, False
    more, dropped = _node(a, extra, join(path, "additionalProperties"), depth)
    return out + more, dropped


def unsupported(schema) -> list[tuple[str, str]]:
    """(path, reason) of every keyword outlines-core's regex does not enforce exactly, in schema
    order; [] when the device tables enforce `schema` exactly."""
    a = _Audit(schema)
    findings, dropped = _node(a, schema, "", 0)
    if dropped:
        findings.append(("", f"a $ref nested deeper than {MAX_REF_DEPTH} is " + NOT_ENFORCED))
    return list(dict.fromkeys(findings))
