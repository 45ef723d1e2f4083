"""The JSON-schema keywords each constraint backend enforces, as a Markdown table computed by the
backends' own checks (docs/structured-outputs.md holds it between marker comments):

    device  the schema compiles to outlines-core's regex (`spec.Constraint.json_schema`) and the
            keyword audit passes it (`keywords.check_device`)
    host    the same Constraint compiles with llguidance on the demo tokenizer
            (`host.compile_grammar`)

A cell is "enforced" or "refused (the reason a request gets)". One probe schema per keyword or
feature, each as small as the keyword allows. jax-free.

    python -m decode.constraints.table                 print the table
    python -m decode.constraints.table --write FILE    replace the table between FILE's markers
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from decode.config import DecodeConfigError
from decode.constraints import host
from decode.constraints.keywords import check_device
from decode.constraints.spec import Constraint

FIELD = "schema"
ENFORCED = "enforced"
BEGIN = ("<!-- BEGIN keyword table (python -m decode.constraints.table --write "
         "docs/structured-outputs.md) -->")
END = "<!-- END keyword table -->"
DEMO_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "demo", "model")
FORMATS = ("date-time", "date", "time", "duration", "email", "idn-email", "hostname",
           "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
           "uri-template", "json-pointer", "relative-json-pointer", "regex")

_NAME = {"type": "object", "properties": {"name": {"type": "string"}}}
_INTS = {"type": "array", "items": {"type": "integer"}}
_NODE = {"type": "object", "properties": {"value": {"type": "integer"},
                                          "next": {"$ref": "#/$defs/node"}},
         "required": ["value"]}
PROBES = (
    *((f"type: {t}", {"type": t})
      for t in ("object", "array", "string", "number", "integer", "boolean", "null")),
    ("type: a list", {"type": ["string", "null"]}),
    ("properties", _NAME),
    ("required", {**_NAME, "required": ["name"]}),
    ("additionalProperties: false", {**_NAME, "additionalProperties": False}),
    ("additionalProperties: true", {**_NAME, "additionalProperties": True}),
    ("additionalProperties: a schema", {"type": "object",
                                        "additionalProperties": {"type": "integer"}}),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}),
    ("minProperties: 1", {"type": "object", "minProperties": 1}),
    ("minProperties: 2", {"type": "object", "minProperties": 2}),
    ("maxProperties: 0", {"type": "object", "maxProperties": 0}),
    ("maxProperties: 2", {"type": "object", "maxProperties": 2}),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"},
                                                            "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}),
    ("dependentSchemas", {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}),
    ("unevaluatedProperties", {**_NAME, "unevaluatedProperties": False}),
    ("items", _INTS),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}),
    ("minItems", {**_INTS, "minItems": 1}),
    ("maxItems", {**_INTS, "maxItems": 3}),
    ("uniqueItems", {**_INTS, "uniqueItems": True}),
    ("contains", {"type": "array", "contains": {"type": "integer"}}),
    ("minLength", {"type": "string", "minLength": 2}),
    ("maxLength", {"type": "string", "maxLength": 8}),
    ("pattern (simple)", {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}),
    ("pattern (lookaround)", {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"}),
    *((f"format: {f}", {"type": "string", "format": f}) for f in FORMATS),
    ("minimum", {"type": "integer", "minimum": 0}),
    ("maximum", {"type": "integer", "maximum": 100}),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1}),
    ("multipleOf", {"type": "integer", "multipleOf": 5}),
    ("enum", {"enum": ["red", "green", 3, None]}),
    ("const", {"const": "fixed"}),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}),
    ("oneOf (disjoint)", {"oneOf": [{"type": "string"}, {"type": "integer"}]}),
    ("oneOf (overlapping)", {"oneOf": [{"type": "number"}, {"type": "integer"}]}),
    ("allOf (one)", {"allOf": [{"type": "string"}]}),
    ("allOf (several)", {"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}),
    ("not", {"type": "string", "not": {"const": "x"}}),
    ("if / then / else", {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 9},
                          "else": {"minimum": -9}}),
    ("$ref (local)", {"type": "object", "properties": {"a": {"type": "string"},
                                                       "b": {"$ref": "#/properties/a"}}}),
    ("$ref (recursive, optional)", {"$defs": {"node": _NODE}, "$ref": "#/$defs/node"}),
    ("$ref (recursive, required)", {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["children"]}),
    ("$defs", {"$defs": {"id": {"type": "integer"}}, "type": "object",
               "properties": {"id": {"$ref": "#/$defs/id"}}}),
    ("annotations (title, description, default, examples)",
     {"type": "string", "title": "t", "description": "d", "default": "a", "examples": ["b"]}),
)


def _reason(error: DecodeConfigError) -> str:
    """The error's text without the field name in front ("minimum: not enforced ...")."""
    text = str(error)
    for head in (FIELD + ": ", FIELD + "."):
        if text.startswith(head):
            return text[len(head):]
    return text


def device_cell(schema: dict) -> str:
    try:
        Constraint.json_schema(schema, FIELD)
        check_device(schema, FIELD)
    except DecodeConfigError as e:
        return f"refused ({_reason(e)})"
    return ENFORCED


def host_cell(schema: dict, tokenizer) -> str:
    try:
        host.compile_grammar(Constraint.json_schema(schema, FIELD), tokenizer, None)
    except DecodeConfigError as e:
        return f"refused ({_reason(e)})"
    return ENFORCED


def demo_tokenizer():
    from wedlm_jax.tokenizer import load_tokenizer
    return load_tokenizer(os.path.normpath(DEMO_TOKENIZER))


def rows(tokenizer=None) -> list[tuple[str, dict, str, str]]:
    """(feature, probe schema, device cell, host cell) of every probe."""
    tokenizer = tokenizer or demo_tokenizer()
    return [(name, schema, device_cell(schema), host_cell(schema, tokenizer))
            for name, schema in PROBES]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(tokenizer=None) -> str:
    """The table, one line a probe (no trailing newline)."""
    lines = ["| keyword | probe schema | device | host |", "|---|---|---|---|"]
    for name, schema, device, host_text in rows(tokenizer):
        probe = _cell(json.dumps(schema, separators=(", ", ": ")))
        lines.append(f"| {_cell(name)} | `{probe}` | {_cell(device)} | {_cell(host_text)} |")
    return "\n".join(lines)


def splice(text: str, table: str) -> str:
    """`text` with the table between its BEGIN and END markers replaced by `table`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN!r} ... {END!r} markers")
    return text[:start + len(BEGIN)] + "\n" + table + "\n" + text[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decode.constraints.table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="FILE", help="replace the table between FILE's "
                        "marker comments instead of printing it")
    args = parser.parse_args(argv)
    table = markdown()
    if args.write is None:
        print(table)
        return 0
    with open(args.write, encoding="utf-8") as f:
        text = f.read()
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(splice(text, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
