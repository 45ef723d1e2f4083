"""Which JSON-schema keywords the device tables enforce exactly, and schemas nothing satisfies.

A JSON schema reaches the device as outlines-core's regular expression (`spec.Constraint`), and
outlines-core reads only part of a schema: each schema object is compiled by the first of
`properties`, `allOf`, `anyOf`, `oneOf`, `prefixItems`, `enum`, `const`, `$ref`, `type` it holds,
and of the rest only a few keywords per type (`minLength` / `maxLength` / `pattern` / `format`
of strings, `items` / `minItems` / `maxItems` of arrays, `additionalProperties` /
`minProperties` up to 1 and `maxProperties` 0 of free-form objects). Every other keyword is silently
dropped, so the output could break its schema.

    unsupported(schema)   [(path, reason)] for every keyword the tables do not enforce exactly
    unsatisfiable(schema) (path, reason) of a part no instance satisfies, or None
    check_device(schema, field)  a DecodeConfigError for the first of either, naming the field

A keyword is accepted only where it is known exact (a whitelist per position, found by checking
outlines-core's automaton against `jsonschema`); a keyword that cannot restrict the value there
(`minimum` beside `"type": "string"`, `additionalProperties` beside `properties`, which
outlines-core never extends) is fine. Keywords outside the JSON-schema vocabularies are
annotations. Paths are dotted, from the schema root (`properties.price.minimum`). The device
forbids some valid instances (properties in schema order, no extra properties beside
`properties`, a pattern matched whole, no `\\u` escapes): a stricter output, never a wrong one.
"""

from __future__ import annotations

import dataclasses
import math
import re

NOT_ENFORCED = "not enforced by the device tables"
MAX_REF_DEPTH = 3                       # outlines-core unrolls a $ref this many times, then drops
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
DISPATCH = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref",
            "type")
FAMILY = {
    "number": ("multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
               "divisibleBy"),
    "string": ("maxLength", "minLength", "pattern", "format"),
    "array": ("items", "prefixItems", "additionalItems", "contains", "minContains",
              "maxContains", "maxItems", "minItems", "uniqueItems", "unevaluatedItems"),
    "object": ("properties", "patternProperties", "additionalProperties", "required",
               "dependentRequired", "dependentSchemas", "dependencies", "propertyNames",
               "minProperties", "maxProperties", "unevaluatedProperties"),
}
KEYWORD_TYPES = {k: fam for fam, keys in FAMILY.items() for k in keys}
# keywords that restrict whatever the type (or refer to what does); everything else outside
# FAMILY is an annotation (title, description, default, examples, $id, $defs, readOnly, ...)
GENERAL = ("type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "$ref",
           "$dynamicRef", "$recursiveRef", "disallow", "extends")
RESTRICTING = frozenset(GENERAL) | frozenset(KEYWORD_TYPES)
STANDARD_FORMATS = frozenset((
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex"))
# outlines-core's regex of these is a subset of the format (date-time, date, time allow
# impossible dates or no offset; uri and email let a quote or a control character through)
EXACT_FORMATS = frozenset(("uuid",))


# ------------------------------------------------------------------------------ small helpers

def _join(path: str, *keys) -> str:
    return ".".join([path, *map(str, keys)]) if path else ".".join(map(str, keys))


def _count(value) -> bool:
    """A non-negative integer as outlines-core reads a count (as_u64: never 2.0 or True)."""
    return type(value) is int and value >= 0


def _number(value) -> bool:
    return type(value) in (int, float) and not (isinstance(value, float) and math.isnan(value))


def _types(value) -> set:
    """The JSON types a `type` keyword names (an unknown name is dropped)."""
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return {t for t in names if t in JSON_TYPES}


def _value_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _admits(declared: set, produced: str) -> bool:
    """Whether a value of type `produced` may be of one of the `declared` types ("number"
    produced: any number, integers included)."""
    if produced == "integer":
        return bool(declared & {"integer", "number"})
    if produced == "number":
        return bool(declared & {"integer", "number"})
    return produced in declared


def _is_type(declared: set, value) -> bool:
    """Whether `value` is of one of the `declared` types (1.0 is an integer)."""
    t = _value_type(value)
    return t in declared or (t == "integer" and "number" in declared)


def _fits(declared: set, produced: set) -> bool:
    """Whether every value of the `produced` types is of a `declared` type."""
    return all(t in declared or (t == "integer" and "number" in declared) for t in produced)


def _dispatch(node: dict) -> str | None:
    """The keyword outlines-core compiles a schema object by (None: {} or nothing it reads)."""
    return next((k for k in DISPATCH if k in node), None)


def _restricting(node: dict) -> list:
    return [k for k in node if k in RESTRICTING and not (k == "format" and _loose_format(node))]


def _loose_format(node: dict) -> bool:
    """A format no validator asserts (not a standard name)."""
    return node.get("format") not in STANDARD_FORMATS


# ------------------------------------------------------------------------------ $ref

def _ref_target(root, ref) -> tuple[str, object] | None:
    """(path, schema) a local $ref names as outlines-core resolves it (None: it cannot)."""
    if not isinstance(ref, str):
        return None
    parts = ref.split("#")
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == ""):
        fragment = parts[-1]
    elif len(parts) == 2 and isinstance(root, dict) and root.get("$id") == parts[0]:
        fragment = parts[1]
    else:
        return None
    keys = [p for p in fragment.split("/") if p]
    node = root
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return ".".join(keys), node


def _deref(root, node, hops: int = 8):
    """`node` with a bare $ref followed (annotations beside it are fine)."""
    while (hops and isinstance(node, dict) and "$ref" in node
           and _restricting(node) == ["$ref"]):
        target = _ref_target(root, node["$ref"])
        if target is None:
            return node
        node, hops = target[1], hops - 1
    return node


# ------------------------------------------------------------------------------ output types

def _produced(root, node, hops: int = 16) -> set:
    """The JSON types outlines-core's regex for `node` can produce (all of them when unsure)."""
    if hops <= 0 or not isinstance(node, dict):
        return set(JSON_TYPES)
    kind = _dispatch(node)
    if kind is None:
        return set(JSON_TYPES)
    if kind == "properties":
        return {"object"}
    if kind in ("allOf", "anyOf", "oneOf") and isinstance(node[kind], list):
        return set().union(*(_produced(root, s, hops - 1) for s in node[kind]))
    if kind == "prefixItems":
        return {"array"}
    if kind in ("enum", "const"):
        values = node[kind] if kind == "enum" and isinstance(node[kind], list) else [node[kind]]
        return {_value_type(v) for v in values}
    if kind == "$ref":
        target = _ref_target(root, node["$ref"])
        return _produced(root, target[1], hops - 1) if target else set(JSON_TYPES)
    return _types(node["type"]) or set(JSON_TYPES)


def _accepted(root, node, hops: int = 16) -> set:
    """A superset of the JSON types `node` validates (JSON-schema semantics)."""
    node = _deref(root, node)
    if hops <= 0 or node is True or not isinstance(node, dict):
        return set() if node is False else set(JSON_TYPES)
    out = set(JSON_TYPES)
    if "type" in node:
        out &= _types(node["type"]) | ({"integer"} if "number" in _types(node["type"]) else set())
    if isinstance(node.get("enum"), list):
        out &= {_value_type(v) for v in node["enum"]}
    if "const" in node:
        out &= {_value_type(node["const"])}
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            out &= set().union(*(_accepted(root, s, hops - 1) for s in node[key]))
    return out


# ------------------------------------------------------------------------------ validation

def _validator(root, schema, formats: bool):
    import jsonschema
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    checker = cls.FORMAT_CHECKER if formats else None
    return cls(root, format_checker=checker).evolve(schema=schema)


def _all_valid(root, schema, values) -> bool:
    """Whether every value validates against `schema` (formats asserted); False when unsure."""
    try:
        v = _validator(root, schema, True)
        return all(v.is_valid(x) for x in values)
    except Exception:                     # noqa: BLE001 (an unresolvable $ref, a bad pattern)
        return False


def _none_valid(root, schema, values) -> bool:
    """Whether no value validates against `schema` (formats not asserted); False when unsure."""
    try:
        v = _validator(root, schema, False)
        return not any(v.is_valid(x) for x in values)
    except Exception:                     # noqa: BLE001
        return False


# ------------------------------------------------------------------------------ oneOf

def _excludes(root, a, b, hops: int = 4) -> bool:
    """Whether nothing outlines-core produces for `a` validates against `b`."""
    a, b = _deref(root, a), _deref(root, b)
    if not isinstance(a, dict) or hops <= 0:
        return False
    if b is False:
        return True
    accepted = _accepted(root, b)
    if not any(_admits(accepted, t) for t in _produced(root, a)):
        return True
    kind = _dispatch(a)
    if kind in ("enum", "const"):
        values = a["enum"] if kind == "enum" else [a["const"]]
        return isinstance(values, list) and _none_valid(root, b, values)
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
    return any(k in b_props and _excludes(root, props[k], b_props[k], hops - 1)
               for k in required)


def _overlap(root, branches: list) -> tuple[int, int] | None:
    """The first (i, j) whose outputs of i may validate against j."""
    for i, a in enumerate(branches):
        for j, b in enumerate(branches):
            if i != j and not _excludes(root, a, b):
                return i, j
    return None


# ------------------------------------------------------------------------------ pattern

_PUNCT = set(".-+*?()[]{}|^$/")
_QUANT = re.compile(r"[*+?]\??|\{\d+(,\d*)?\}\??")


def _plain(ch: str) -> bool:
    """A character that a JSON string holds as itself (no escape needed)."""
    return ch not in '"\\' and ord(ch) >= 0x20 and not 0x7F <= ord(ch) <= 0x9F


def _class_end(p: str, i: int) -> int | None:
    """The index after the class at p[i] == "[", or None when outside the safe subset (no
    negation, no nested class or set operation, no character needing a JSON escape)."""
    i += 1
    if i < len(p) and p[i] == "^":
        return None
    prev = None
    while i < len(p) and p[i] != "]":
        ch = p[i]
        if ch == "\\":
            esc = p[i + 1:i + 2]
            if esc != "d" and esc not in _PUNCT:
                return None
            prev, i = (None if esc == "d" else esc), i + 2
        elif ch == "-" and prev is not None and i + 1 < len(p) and p[i + 1] != "]":
            hi = p[i + 1]
            if hi in "\\[" or not all(_plain(chr(c)) for c in range(ord(prev), ord(hi) + 1)):
                return None
            prev, i = None, i + 2
        elif ch == "[" or not _plain(ch) or p[i:i + 2] in ("&&", "--", "~~"):
            return None
        else:
            prev, i = ch, i + 1
    return i + 1 if i < len(p) and i > 0 else None


def _sequence_end(p: str, i: int, top: bool) -> int | None:
    """The index where the sequence from p[i] ends (")" or the end), None when unsafe."""
    while i < len(p):
        ch = p[i]
        if ch == ")" and not top:
            return i
        if ch == "|" and not top:
            i += 1
            continue
        if ch == "(":
            start = i + 3 if p.startswith("(?:", i) else i + 1
            if p[start:start + 1] == "?":
                return None
            end = _sequence_end(p, start, False)
            if end is None or end >= len(p):
                return None
            i = end + 1
        elif ch == "[":
            i = _class_end(p, i)
            if i is None:
                return None
        elif ch == "\\":
            esc = p[i + 1:i + 2]
            if esc != "d" and esc not in _PUNCT:
                return None
            i += 2
        elif ch in "|)^$*+?{}]." or not _plain(ch):
            return None
        else:
            i += 1
        m = _QUANT.match(p, i)
        if m:
            i = m.end()
    return i


def safe_pattern(pattern: str) -> bool:
    """Whether outlines-core's `"` + pattern + `"` (anchors ^...$ stripped) only produces JSON
    strings whose text matches `pattern` in full, with the same meaning in Python's `re`:
    literals, escaped punctuation, `\\d`, classes of such, groups, alternation inside a group,
    quantifiers. `.`, `\\w`, `\\s`, negated classes, look-around and top-level `|` are not."""
    if pattern.startswith("^") and pattern.endswith("$") and len(pattern) >= 2:
        pattern = pattern[1:-1]
    if pattern.endswith("\\") or _QUANT.match(pattern):
        return False
    return _sequence_end(pattern, 0, True) == len(pattern)


# ------------------------------------------------------------------------------ the audit

@dataclasses.dataclass
class _Audit:
    root: object
    memo: dict = dataclasses.field(default_factory=dict)


def _issue(path, key, reason=NOT_ENFORCED) -> list:
    return [(_join(path, key), reason)]


def _node(a: _Audit, node, path: str, depth: int) -> tuple[list, bool]:
    """(issues, dropped) of one schema position; dropped: outlines-core gives up on it here
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
    kind = _dispatch(node)
    if kind is None:
        return [(path, "a schema without type, properties or a combinator is "
                 + NOT_ENFORCED)], False
    if kind == "type":
        return _typed(a, node, path, depth)
    return {"properties": _properties, "allOf": _all_of, "anyOf": _any_of, "oneOf": _one_of,
            "prefixItems": _prefix_items, "enum": _enum, "const": _enum,
            "$ref": _ref}[kind](a, node, path, depth)


def _children(a: _Audit, pairs, depth: int) -> tuple[list, bool]:
    issues, dropped = [], False
    for sub, path in pairs:
        more, gone = _node(a, sub, path, depth)
        issues += more
        dropped |= gone
    return issues, dropped


def _siblings(a: _Audit, node: dict, path: str, kind: str, fine=()) -> list:
    """Issues of the keywords beside `kind` that outlines-core drops: fine when they cannot
    restrict what it produces (`fine`: those this position satisfies anyway)."""
    produced = _produced(a.root, node)
    out = []
    for key in _restricting(node):
        if key == kind or key in fine:
            continue
        if key == "type" and _fits(_types(node["type"]), produced):
            continue
        fam = KEYWORD_TYPES.get(key)
        if fam and not any(_admits({fam}, t) if fam == "number" else t == fam
                           for t in produced):
            continue
        out += _issue(path, key)
    return out


def _properties(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    props = node["properties"]
    if not isinstance(props, dict):
        return _issue(path, "properties"), False
    required = node.get("required", [])
    required = required if isinstance(required, list) else []
    fine = ["additionalProperties", "unevaluatedProperties"]
    out = []
    missing = [r for r in required if r not in props]
    if missing:
        out += _issue(path, "required", f"required property {missing[0]!r} is not in "
                      "properties: " + NOT_ENFORCED)
    fine.append("required")
    n_req = len([r for r in props if r in required])
    if _count(node.get("minProperties")) and node["minProperties"] <= n_req:
        fine.append("minProperties")
    if _count(node.get("maxProperties")) and node["maxProperties"] >= len(props):
        fine.append("maxProperties")
    out += _siblings(a, node, path, "properties", fine)
    for name, sub in props.items():
        p = _join(path, "properties", name)
        if not all(_plain(ch) for ch in name):
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
        return _issue(path, "allOf", "allOf of more than one schema is " + NOT_ENFORCED), False
    out, dropped = _children(a, [(subs[0], _join(path, "allOf", 0))], depth)
    return _siblings(a, node, path, "allOf") + out, dropped


def _any_of(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    subs = node["anyOf"]
    if not isinstance(subs, list) or not subs:
        return _issue(path, "anyOf"), False
    out, dropped = _children(a, [(s, _join(path, "anyOf", i)) for i, s in enumerate(subs)],
                             depth)
    return _siblings(a, node, path, "anyOf") + out, dropped


def _one_of(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    subs = node["oneOf"]
    if not isinstance(subs, list) or not subs:
        return _issue(path, "oneOf"), False
    out = _siblings(a, node, path, "oneOf")
    if _overlap(a.root, subs):
        out += _issue(path, "oneOf", "oneOf with overlapping branches")
    more, dropped = _children(a, [(s, _join(path, "oneOf", i)) for i, s in enumerate(subs)],
                              depth)
    return out + more, dropped


def _prefix_items(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    subs = node["prefixItems"]
    if not isinstance(subs, list):
        return _issue(path, "prefixItems"), False
    fine = ["items", "additionalItems", "unevaluatedItems"]
    if _count(node.get("minItems")) and node["minItems"] <= len(subs):
        fine.append("minItems")
    if _count(node.get("maxItems")) and node["maxItems"] >= len(subs):
        fine.append("maxItems")
    if node.get("uniqueItems") is False or len(subs) <= 1:
        fine.append("uniqueItems")
    out, dropped = _children(
        a, [(s, _join(path, "prefixItems", i)) for i, s in enumerate(subs)], depth)
    return _siblings(a, node, path, "prefixItems", fine) + out, dropped


def _enum(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    kind = "enum" if "enum" in node else "const"
    values = node[kind] if kind == "enum" else [node[kind]]
    if not isinstance(values, list):
        return _issue(path, kind), False
    if any(isinstance(v, (dict, list)) for v in values):
        return _issue(path, kind, f"{kind} of objects or arrays is " + NOT_ENFORCED), False
    if not _all_valid(a.root, node, values):
        return _issue(path, kind, f"{kind} with values the schema's other keywords forbid"), False
    fine = [k for k in _restricting(node) if k != kind]
    return _siblings(a, node, path, kind, fine), False


def _ref(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    out = _siblings(a, node, path, "$ref", ["$ref"])
    if depth > MAX_REF_DEPTH:
        return out, True
    target = _ref_target(a.root, node["$ref"])
    if target is None:
        return out + _issue(path, "$ref", "a $ref outside the schema is " + NOT_ENFORCED), False
    more, dropped = _node(a, target[1], target[0], depth + 1)
    return out + more, dropped


def _typed(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    types = node["type"]
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if not names or not all(t in JSON_TYPES for t in names):
        return _issue(path, "type"), False
    out, dropped = [], False
    for key in _restricting(node):
        fam = KEYWORD_TYPES.get(key)
        if key != "type" and not fam:
            out += _issue(path, key)
    if "string" in names:
        out += _string(node, path)
    if "number" in names or "integer" in names:
        out += [(_join(path, k), NOT_ENFORCED) for k in FAMILY["number"] if k in node]
    if "array" in names:
        more, dropped = _array(a, node, path, depth)
        out += more
    if "object" in names:
        more, gone = _object(a, node, path, depth)
        out, dropped = out + more, dropped or gone
    return out, dropped


def _string(node: dict, path: str) -> list:
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    out = [(_join(path, k), NOT_ENFORCED) for k in lengths if not _count(node[k])]
    if lengths:
        rest = ["pattern"] + ([] if _loose_format(node) else ["format"])
        return out + [(_join(path, k), NOT_ENFORCED) for k in rest if k in node]
    if "pattern" in node:
        p = node["pattern"]
        out = [] if isinstance(p, str) and safe_pattern(p) else _issue(
            path, "pattern", "a pattern outside the exact regex subset is " + NOT_ENFORCED)
        if isinstance(p, str) and "format" in node and not _loose_format(node):
            out += _issue(path, "format")
        return out
    if "format" in node and node["format"] not in EXACT_FORMATS:
        return _issue(path, "format", f"format {node['format']!r} is " + NOT_ENFORCED)
    return []


def _array(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    out = [(_join(path, k), NOT_ENFORCED) for k in ("minItems", "maxItems")
           if k in node and not _count(node[k])]
    unique_fine = node.get("uniqueItems") is False or (
        _count(node.get("maxItems")) and node["maxItems"] <= 1)
    for key in ("contains", "minContains", "maxContains", "uniqueItems", "unevaluatedItems"):
        if key in node and not (key == "uniqueItems" and unique_fine) and not (
                key == "unevaluatedItems" and "items" in node):
            out += _issue(path, key)
    if "items" not in node or node.get("maxItems") == 0:
        return out, False
    if isinstance(node["items"], list):
        return out + _issue(path, "items", "items as a list is " + NOT_ENFORCED), False
    more, dropped = _node(a, node["items"], _join(path, "items"), depth)
    return out + more, dropped


def _object(a: _Audit, node: dict, path: str, depth: int) -> tuple[list, bool]:
    out = [(_join(path, k), NOT_ENFORCED) for k in ("minProperties", "maxProperties")
           if k in node and not _count(node[k])]
    if _count(node.get("minProperties")) and node["minProperties"] > 1:
        out += _issue(path, "minProperties", "minProperties above 1 (keys may repeat) is "
                      + NOT_ENFORCED)
    if _count(node.get("maxProperties")) and node["maxProperties"] > 0:
        out += _issue(path, "maxProperties", "maxProperties above 0 is " + NOT_ENFORCED)
    for key in ("patternProperties", "dependentRequired", "dependentSchemas", "dependencies",
                "propertyNames", "unevaluatedProperties"):
        if key in node:
            out += _issue(path, key)
    if node.get("required"):
        out += _issue(path, "required", "required without properties is " + NOT_ENFORCED)
    if node.get("maxProperties") == 0:
        return out, False
    extra = node.get("additionalProperties", True)
    if extra is True:
        return out, False
    more, dropped = _node(a, extra, _join(path, "additionalProperties"), depth)
    return out + more, dropped


def unsupported(schema) -> list[tuple[str, str]]:
    """(path, reason) of every keyword outlines-core's regex does not enforce exactly, in schema
    order; [] when the device tables enforce `schema` exactly."""
    a = _Audit(schema)
    issues, dropped = _node(a, schema, "", 0)
    if dropped:
        issues.append(("", f"a $ref nested deeper than {MAX_REF_DEPTH} is " + NOT_ENFORCED))
    return list(dict.fromkeys(issues))


# ------------------------------------------------------------------------------ unsatisfiable

_BOUNDS = (("minimum", "maximum", ">"), ("exclusiveMinimum", "exclusiveMaximum", ">="),
           ("minLength", "maxLength", ">"), ("minItems", "maxItems", ">"),
           ("minProperties", "maxProperties", ">"))


def _bounds(node: dict, path: str) -> tuple[str, str] | None:
    for lo, hi, op in _BOUNDS:
        x, y = node.get(lo), node.get(hi)
        if _number(x) and _number(y) and (x > y if op == ">" else x >= y):
            return _join(path, lo), f"{lo} {x:g} {op} {hi} {y:g}"
    return None


def _empty(a: _Audit, node: dict, path: str) -> tuple[str, str] | None:
    """A keyword of `node` itself that no instance satisfies."""
    if node.get("enum") == []:
        return _join(path, "enum"), "enum is empty"
    if node.get("type") == []:
        return _join(path, "type"), "type is an empty list"
    if node.get("not") in ({}, True):
        return _join(path, "not"), "not {} forbids every instance"
    if "const" in node and "type" in node and not _is_type(_types(node["type"]), node["const"]):
        return (_join(path, "const"), f"const {node['const']!r} is not of type "
                f"{' or '.join(sorted(_types(node['type'])))}")
    return _bounds(node, path) or _required(node, path) or _all_of_types(a, node, path)


def _required(node: dict, path: str) -> tuple[str, str] | None:
    required = node.get("required") if isinstance(node.get("required"), list) else []
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in required:
        if props.get(name) is False:
            return _join(path, "properties", name), f"required property {name!r} is false"
        if (name not in props and node.get("additionalProperties") is False
                and not node.get("patternProperties")):
            return (_join(path, "required"), f"required property {name!r} is forbidden by "
                    "additionalProperties false")
    return None


def _all_of_types(a: _Audit, node: dict, path: str) -> tuple[str, str] | None:
    subs = node.get("allOf")
    if not isinstance(subs, list) or not subs:
        return None
    sets = [_accepted(a.root, s) for s in subs]
    if "type" in node:
        sets.append(_accepted(a.root, {"type": node["type"]}))
    common = set.intersection(*sets)
    if common:
        return None
    named = sorted({t for s in subs if isinstance(s, dict) for t in _types(s.get("type"))})
    what = " and ".join(named) if named else "contradictory types"
    return _join(path, "allOf"), f"allOf of types {what} has no common type"


def _subschemas(node: dict, path: str):
    """(schema, path) of the schemas directly inside `node`."""
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(node.get(key), dict):
            yield from ((s, _join(path, key, k)) for k, s in node[key].items())
    for key in ("allOf", "anyOf", "oneOf", "prefixItems", "items"):
        if isinstance(node.get(key), list):
            yield from ((s, _join(path, key, i)) for i, s in enumerate(node[key]))
    for key in ("items", "additionalProperties", "additionalItems", "contains", "not", "if",
                "then", "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems"):
        if isinstance(node.get(key), dict):
            yield node[key], _join(path, key)


def unsatisfiable(schema) -> tuple[str, str] | None:
    """(path, reason) of the first part of `schema` that no instance satisfies, or None."""
    if schema is False:
        return "", "the schema is false"
    a = _Audit(schema)
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        found = _empty(a, node, path)
        if found:
            return found
        stack.extend(reversed(list(_subschemas(node, path))))
    return None


def check_device(schema, field: str) -> None:
    """Raise DecodeConfigError(`field.path: reason`) for the first unsatisfiable or unsupported
    part of `schema`; None when the device tables enforce it exactly."""
    from decode.config import DecodeConfigError
    found = unsatisfiable(schema)
    if found is None:
        issues = unsupported(schema)
        found = issues[0] if issues else None
    if found is None:
        return None
    where = _join(field, found[0]) if found[0] else field
    raise DecodeConfigError(f"{where}: {found[1]}", where)
