"""The JSON-schema keyword audit (decode/constraints/keywords.py): schemas it accepts are enforced
exactly by the device tables (checked against `jsonschema` on boundary instances, over a
one-byte-per-token vocabulary), the keywords outlines-core drops are refused at their path, and
schemas nothing satisfies are named."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest

from decode.config import DecodeConfigError
from decode.constraints.automaton import build_index, tables
from decode.constraints.keywords import check_device, safe_pattern, unsatisfiable, unsupported
from decode.constraints.spec import WHITESPACE

BYTES = {bytes([b]): [b] for b in range(256)}
SCALARS = [None, True, False, -1, 0, 0.5, 18, 1e3, -10.99, "", "a", "ab", "abc", "abcd",
           "abcde", "é", "éé", "ééé", "a\"b", "a\\b", "b", "ba",
           "123e4567-e89b-12d3-a456-426614174000"]
ARRAYS = [[], [0], [0, 1], [1, "a"], ["a", 1], [0, 1, 2], ["a", "b", "c"], [0.5], [[0]]]
OBJECTS = [{}, {"a": 1}, {"a": "x"}, {"a": 1, "b": "x"}, {"b": "x"}, {"a": 1, "c": 2},
           {"a": 1, "b": "x", "c": 2}, {"c": 2}, {"a": None}, {"a": {"a": 1}}, {"a": 0.5}]
CANDIDATES = SCALARS + ARRAYS + OBJECTS

# (schema, exact both ways among the candidates: no valid candidate is forbidden either)
ACCEPTED = [
    ({"type": "integer"}, False),                                    # 1000.0 written as such
    ({"type": "number"}, True),
    ({"type": "boolean"}, True),
    ({"type": ["string", "null"], "maxLength": 2}, True),
    ({"type": "string", "minLength": 1, "maxLength": 3}, False),     # no escapes of " or \
    ({"type": "string", "minimum": 3, "maxItems": 1}, False),        # keywords of other types
    ({"type": "string", "pattern": "^[a-c]+$"}, False),
    ({"type": "string", "pattern": "b"}, False),                      # matched whole
    ({"type": "string", "pattern": "^(a|b)\\d{0,2}$"}, False),
    ({"type": "string", "format": "uuid"}, True),
    ({"enum": ["a", 18, None]}, True),
    ({"type": "string", "enum": ["a", "ab"]}, True),
    ({"const": 18}, True),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}, False),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]}, False),
    ({"oneOf": [{"const": "a"}, {"const": "b"}]}, True),
    ({"allOf": [{"type": "string"}]}, True),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, True),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1}, True),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
      "minItems": 1}, False),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "required": ["a"]}, False),                                     # no extra properties
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": False}, True),
    ({"properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "additionalProperties": {"type": "integer"}, "required": ["b"], "maxProperties": 2}, False),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}, True),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 0}, True),
    ({"$defs": {"A": {"type": "integer", "description": "an A"}},
      "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}, False),
    ({"$defs": {"N": {"type": "object", "properties": {"a": {"$ref": "#/$defs/N"}}}},
      "$ref": "#/$defs/N"}, False),                                    # recursion unrolled
    ({"type": "object", "properties": {"a": {"oneOf": [
        {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
        {"type": "integer"}]}}}, False),
]


@functools.lru_cache(maxsize=None)
def device(schema_text: str):
    from outlines_core.json_schema import build_regex_from_schema
    regex = build_regex_from_schema(schema_text, WHITESPACE)
    return tables(build_index(regex, BYTES, 256), 256)


def allows(schema: dict, instance) -> bool:
    """Whether the tables of `schema` take `instance` as json.dumps writes it, then stop."""
    klass, trans, accept = device(json.dumps(schema))
    state = 0
    for b in json.dumps(instance, ensure_ascii=False).encode():
        state = int(trans[state, klass[b]])
        if state < 0:
            return False
    return bool(accept[state])


@pytest.mark.parametrize("schema,tight", ACCEPTED, ids=lambda x: json.dumps(x)[:60])
def test_accepted_schemas_are_exact(schema, tight):
    assert unsupported(schema) == [] and unsatisfiable(schema) is None
    check_device(schema, "response_format.json_schema.schema")
    valid = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).is_valid
    allowed_invalid = [c for c in CANDIDATES if allows(schema, c) and not valid(c)]
    assert allowed_invalid == []
    if tight:
        assert [c for c in CANDIDATES if valid(c) and not allows(schema, c)] == []
    assert any(allows(schema, c) for c in CANDIDATES)


REFUSED = [
    ({"type": "number", "minimum": 0}, "minimum", -10.99),
    ({"type": "integer", "maximum": 10}, "maximum", 18),
    ({"properties": {"price": {"type": "number", "exclusiveMinimum": 0}}},
     "properties.price.exclusiveMinimum", {"price": -1}),
    ({"type": "integer", "multipleOf": 2}, "multipleOf", 1),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", [0, 0]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "contains", []),
    ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 5}}, "if", 18),
    ({"type": "object", "additionalProperties": {"type": "integer"},
      "patternProperties": {"^a": {"type": "string"}}},
     "patternProperties", {"a": 1}),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "patternProperties": {"^a": {"type": "string"}}}, "patternProperties", {"a": 1}),
    ({"type": "object", "additionalProperties": {"type": "integer"},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", {"a": 1}),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
     "minProperties", {"a": 1}),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     "maxProperties", {"a": 1, "c": 2}),
    ({"type": "object", "required": ["a"]}, "required", {}),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "required", {"a": 1}),
    ({"type": "integer", "not": {"const": 0}}, "not", 0),
    ({"type": "string", "format": "date-time"}, "format", None),
    ({"type": "string", "format": "email"}, "format", None),
    ({"type": "string", "format": "date", "maxLength": 10}, "format", "x"),
    ({"type": "string", "format": "date"}, "format", "2023-02-31"),
    ({"type": "string", "pattern": "^a", "minLength": 1}, "pattern", "b"),
    ({"type": "string", "pattern": "^a|b$"}, "pattern", None),
    ({"type": "string", "pattern": "^.*$"}, "pattern", None),
    ({"type": "string", "pattern": "^[^a]+$"}, "pattern", None),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf", 1),
    ({"type": "array", "items": {"anyOf": [{"type": "null"}, {"oneOf": [
        {"type": "string"}, {"type": "string", "maxLength": 1}]}]}}, "items.anyOf.1.oneOf", ["a"]),
    ({"$defs": {"Foo": {"type": "array", "items": {"type": "integer"},
                          "uniqueItems": True}}, "$ref": "#/$defs/Foo"},
     "$defs.Foo.uniqueItems", [0, 0]),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf", None),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "maxLength": 1}, "maxLength", "ab"),
    ({"$ref": "#/$defs/A", "minimum": 3, "$defs": {"A": {"type": "integer"}}}, "minimum", 0),
    ({"type": "string", "enum": ["a", 1]}, "enum", 1),
    ({"type": "object", "properties": {"a b\"": {"type": "integer"}}}, 'properties.a b"', None),
    ({"$defs": {"N": {"type": "object", "properties": {
        "v": {"type": "integer"}, "n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/N"}]}},
        "required": ["v", "n"]}}, "$ref": "#/$defs/N"}, "$defs.N.properties.n", None),
]


@pytest.mark.parametrize("schema,path,witness", REFUSED, ids=lambda x: json.dumps(x)[:60])
def test_dropped_keywords_are_refused_at_their_path(schema, path, witness):
    issues = unsupported(schema)
    assert issues and issues[0][0] == path, issues
    with pytest.raises(DecodeConfigError) as e:
        check_device(schema, "response_format.json_schema.schema")
    assert str(e.value).startswith(f"response_format.json_schema.schema.{path}: ")
    assert e.value.field == f"response_format.json_schema.schema.{path}"
    if witness is not None and path.split(".")[-1] not in ("required", "pattern"):
        assert allows(schema, witness)                  # the refusal is needed
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        assert not jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(
            witness)


def test_refusal_reasons_read_plainly():
    assert unsupported({"type": "number", "minimum": 0}) == [
        ("minimum", "not enforced by the device tables")]
    assert unsupported({"oneOf": [{"type": "number"}, {"type": "integer"}]}) == [
        ("oneOf", "oneOf with overlapping branches")]


UNSATISFIABLE = [
    ({"enum": []}, "enum", "enum is empty"),
    ({"type": "integer", "minimum": 10, "maximum": 3}, "minimum", "minimum 10 > maximum 3"),
    ({"type": "number", "exclusiveMinimum": 5, "exclusiveMaximum": 5}, "exclusiveMinimum",
     "exclusiveMinimum 5 >= exclusiveMaximum 5"),
    ({"properties": {"s": {"type": "string", "minLength": 4, "maxLength": 2}}},
     "properties.s.minLength", "minLength 4 > maxLength 2"),
    ({"type": "array", "minItems": 5, "maxItems": 2}, "minItems", "minItems 5 > maxItems 2"),
    ({"type": "object", "minProperties": 3, "maxProperties": 1}, "minProperties",
     "minProperties 3 > maxProperties 1"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"],
      "additionalProperties": False}, "required",
     "required property 'b' is forbidden by additionalProperties false"),
    ({"type": "integer", "const": "x"}, "const", "const 'x' is not of type integer"),
    ({"type": []}, "type", "type is an empty list"),
    ({"type": "string", "not": {}}, "not", "not {} forbids every instance"),
    (False, "", "the schema is false"),
    ({"properties": {"a": False}, "required": ["a"]}, "properties.a",
     "required property 'a' is false"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf",
     "allOf of types integer and string has no common type"),
]


@pytest.mark.parametrize("schema,path,reason", UNSATISFIABLE, ids=lambda x: json.dumps(x)[:60])
def test_unsatisfiable_schemas_are_named(schema, path, reason):
    assert unsatisfiable(schema) == (path, reason)
    field = "response_format.json_schema.schema"
    where = f"{field}.{path}" if path else field
    with pytest.raises(DecodeConfigError, match="^" + json.dumps(f"{where}: {reason}")[1:-1]):
        check_device(schema, field)


@pytest.mark.parametrize("backend", ["auto", "host", "device"])
def test_an_unsatisfiable_schema_is_refused_by_its_path_on_every_backend(backend):
    """A bound nothing meets inside a required property: every backend names the keyword's path
    (the host's own parser would only say the required property is unsatisfiable)."""
    from decode.constraints.backends import compile_for
    from decode.constraints.spec import Constraint
    from decode.text import load_tokenizer
    from demo.eval import DEMO_MODEL
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 5,
                                                       "maximum": 2}}, "required": ["age"]}
    field = "response_format.json_schema.schema"
    want = f"{field}.properties.age.minimum: minimum 5 > maximum 2"
    with pytest.raises(DecodeConfigError, match="^" + want + "$") as e:
        compile_for(Constraint.json_schema(schema, field), load_tokenizer(DEMO_MODEL), 512, backend)
    assert e.value.field == f"{field}.properties.age.minimum"


def test_satisfiable_bounds_pass():
    assert unsatisfiable({"type": "integer", "minimum": 3, "maximum": 3}) is None
    assert unsatisfiable({"type": "number", "const": 1}) is None
    assert unsatisfiable({"allOf": [{"type": "number"}, {"type": "integer"}]}) is None


@pytest.mark.parametrize("pattern,safe", [
    ("^[a-z0-9_-]+$", True), ("^\\d{3}-\\d{4}$", True), ("^(foo|bar)(\\.baz)?$", True),
    ("abc", True), ("^[A-Fa-f\\d]{24}$", True), ("^a|b$", False), (".*", False),
    ("^\\w+$", False), ("^[^\"]*$", False), ("^[ -~]+$", False), ("^a\\nb$", False),
    ("^(?=a)a$", False), ("^[a[b]]$", False), ("^[a&&b]$", False), ("^a{,3}$", False)])
def test_safe_pattern_subset(pattern, safe):
    assert safe_pattern(pattern) is safe
