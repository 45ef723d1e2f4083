"""What the keyword checks share: the vocabulary of JSON-schema keywords, how outlines-core picks
the keyword it compiles a schema object by, local `$ref`s resolved as it resolves them, and the
JSON types a schema produces (outlines-core's regex) or accepts (JSON-schema semantics)."""

from __future__ import annotations

import math

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


# ------------------------------------------------------------------------------ reading values

def join(path: str, *keys) -> str:
    """The dotted path of `keys` below `path` ("" is the root)."""
    return ".".join([path, *map(str, keys)]) if path else ".".join(map(str, keys))


def is_count(value) -> bool:
    """A non-negative integer as outlines-core reads a count (as_u64: never 2.0 or True)."""
    return type(value) is int and value >= 0


def is_number(value) -> bool:
    return type(value) in (int, float) and not (isinstance(value, float) and math.isnan(value))


def declared_types(value) -> set:
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


def admits(declared: set, produced: str) -> bool:
    """Whether a value of type `produced` may be of one of the `declared` types ("number"
    produced: any number, integers included)."""
    if produced == "integer":
        return bool(declared & {"integer", "number"})
    if produced == "number":
        return bool(declared & {"integer", "number"})
    return produced in declared


def is_type(declared: set, value) -> bool:
    """Whether `value` is of one of the `declared` types (1.0 is an integer)."""
    t = _value_type(value)
    return t in declared or (t == "integer" and "number" in declared)


def fits(declared: set, produced: set) -> bool:
    """Whether every value of the `produced` types is of a `declared` type."""
    return all(t in declared or (t == "integer" and "number" in declared) for t in produced)


def dispatch(node: dict) -> str | None:
    """The keyword outlines-core compiles a schema object by (None: {} or nothing it reads)."""
    return next((k for k in DISPATCH if k in node), None)


def restricting(node: dict) -> list:
    """The keywords of `node` that restrict its instances (a non-standard format does not)."""
    return [k for k in node if k in RESTRICTING and not (k == "format" and loose_format(node))]


def loose_format(node: dict) -> bool:
    """A format no validator asserts (not a standard name)."""
    return node.get("format") not in STANDARD_FORMATS


# ------------------------------------------------------------------------------ $ref

def ref_target(root, ref) -> tuple[str, object] | None:
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


def deref(root, node, hops: int = 8):
    """`node` with a bare $ref followed (annotations beside it are fine)."""
    while (hops and isinstance(node, dict) and "$ref" in node
           and restricting(node) == ["$ref"]):
        target = ref_target(root, node["$ref"])
        if target is None:
            return node
        node, hops = target[1], hops - 1
    return node


# ------------------------------------------------------------------------------ output types

def produced(root, node, hops: int = 16) -> set:
    """The JSON types outlines-core's regex for `node` can produce (all of them when unsure)."""
    if hops <= 0 or not isinstance(node, dict):
        return set(JSON_TYPES)
    kind = dispatch(node)
    if kind is None:
        return set(JSON_TYPES)
    if kind == "properties":
        return {"object"}
    if kind in ("allOf", "anyOf", "oneOf") and isinstance(node[kind], list):
        return set().union(*(produced(root, s, hops - 1) for s in node[kind]))
    if kind == "prefixItems":
        return {"array"}
    if kind in ("enum", "const"):
        values = node[kind] if kind == "enum" and isinstance(node[kind], list) else [node[kind]]
        return {_value_type(v) for v in values}
    if kind == "$ref":
        target = ref_target(root, node["$ref"])
        return produced(root, target[1], hops - 1) if target else set(JSON_TYPES)
    return declared_types(node["type"]) or set(JSON_TYPES)


def accepted(root, node, hops: int = 16) -> set:
    """A superset of the JSON types `node` validates (JSON-schema semantics)."""
    node = deref(root, node)
    if hops <= 0 or node is True or not isinstance(node, dict):
        return set() if node is False else set(JSON_TYPES)
    out = set(JSON_TYPES)
    if "type" in node:
        named = declared_types(node["type"])
        out &= named | ({"integer"} if "number" in named else set())
    if isinstance(node.get("enum"), list):
        out &= {_value_type(v) for v in node["enum"]}
    if "const" in node:
        out &= {_value_type(node["const"])}
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            out &= set().union(*(accepted(root, s, hops - 1) for s in node[key]))
    return out
