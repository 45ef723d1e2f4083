"""What a request asks its output to match, checked before any decoding, in the words of the
request field it came from.

    Constraint.json_schema(schema)   a JSON schema (dict or JSON text)
    Constraint.json_object()         any JSON object
    Constraint.regex(pattern)        a regular expression (the whole output matches it)
    Constraint.choice(options)       one of the given strings

`from_fields(body)` reads the fields of every door (OpenAI `response_format`, vLLM
`structured_outputs` and the older `guided_json` / `guided_regex` / `guided_choice`); a malformed
value is a DecodeConfigError naming the field. The regular expression a constraint compiles to
(`to_regex`) comes from outlines-core (JSON schema -> regex), never from code of ours.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

from decode.config import DecodeConfigError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON's whitespace between tokens: at most one space (what json.dumps writes), so a model
# cannot spin in whitespace; a schema's strings, numbers and structure are unchanged
WHITESPACE = r"[ ]?"
# json_object: any object whose values are scalars, arrays of scalars or objects of scalars (the
# unbounded JSON grammar's automaton takes seconds to build on a 512-token vocabulary)
_SCALAR = {"type": ["string", "number", "boolean", "null"]}
JSON_OBJECT_SCHEMA = json.dumps({"type": "object", "additionalProperties": {"anyOf": [
    _SCALAR, {"type": "array", "items": _SCALAR},
    {"type": "object", "additionalProperties": _SCALAR}]}})
MAX_REPEAT = 1000          # a counted repetition {n} / {n,m} above this is refused
MAX_CHOICES = 1024
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A checked constraint. `value`: canonical JSON text (json_schema), the pattern (regex), a
    tuple of strings (choice), None (json_object). `field`: the request field it came from (the
    errors name it). Equal constraints hash alike (`key`), whatever field they came from."""
    kind: str
    value: object = None
    field: str = "constraint"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DecodeConfigError(f"{self.field}: the constraint kind must be one of "
                                    f"{', '.join(KINDS)}, got {self.kind!r}", self.field)

    @staticmethod
    def json_schema(schema, field: str = "json_schema") -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise DecodeConfigError(f"{field}: not valid JSON ({e})", field) from None
        if not isinstance(schema, dict):
            raise DecodeConfigError(f"{field}: a JSON schema must be an object, got "
                                    f"{type(schema).__name__}", field)
        check_schema(schema, field)
        return Constraint("json_schema", json.dumps(schema), field)   # property order kept

    @staticmethod
    def json_object(field: str = "response_format") -> "Constraint":
        return Constraint("json_object", None, field)

    @staticmethod
    def regex(pattern, field: str = "regex") -> "Constraint":
        if not isinstance(pattern, str) or not pattern:
            raise DecodeConfigError(f"{field}: a regular expression must be a non-empty string, "
                                    f"got {pattern!r}", field)
        for m in _REPEAT.finditer(pattern):
            if max(int(m.group(1)), int(m.group(2) or 0)) > MAX_REPEAT:
                raise DecodeConfigError(f"{field}: a counted repetition {m.group(0)} is above "
                                        f"{MAX_REPEAT}", field)
        return Constraint("regex", pattern, field)

    @staticmethod
    def choice(options, field: str = "choice") -> "Constraint":
        if (not isinstance(options, (list, tuple)) or not options
                or not all(isinstance(o, str) and o for o in options)):
            raise DecodeConfigError(f"{field}: a choice must be a non-empty list of non-empty "
                                    f"strings, got {options!r}", field)
        if len(options) > MAX_CHOICES:
            raise DecodeConfigError(f"{field}: at most {MAX_CHOICES} choices, got {len(options)}",
                                    field)
        return Constraint("choice", tuple(dict.fromkeys(options)), field)

    @staticmethod
    def grammar(lark: str, field: str = "grammar") -> "Constraint":
        """A Lark grammar in llguidance's dialect (JSON schemas inline as `%json {...}`, lazy
        triggers): the host backend's alone (tool calls are built as one)."""
        if not isinstance(lark, str) or not lark.strip():
            raise DecodeConfigError(f"{field}: a grammar must be a non-empty string", field)
        return Constraint("grammar", lark, field)

    def key(self) -> str:
        """The constraint's hash (the automaton cache's key, with the vocabulary's)."""
        return hashlib.sha256(json.dumps([self.kind, self.value]).encode()).hexdigest()

    def to_regex(self) -> str:
        """The regular expression the output must match (outlines-core for JSON, in a child
        process: decode.constraints.schema_regex)."""
        from decode.constraints.schema_regex import regex_from_schema
        if self.kind == "regex":
            return self.value
        if self.kind == "grammar":
            raise DecodeConfigError(f"{self.field}: a grammar is not a regular language; the host "
                                    f"backend takes it", self.field)
        if self.kind == "choice":
            return "(" + "|".join(escape(o) for o in self.value) + ")"
        schema = self.value if self.kind == "json_schema" else JSON_OBJECT_SCHEMA
        return regex_from_schema(schema, WHITESPACE, self.field)


def check_schema(schema: dict, field: str) -> None:
    """`schema` checked against its JSON Schema draft's metaschema: a value that is no schema is
    refused at the door (a schema the backends cannot enforce is refused when compiled)."""
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = ".".join(str(p) for p in e.absolute_path)
        raise DecodeConfigError(f"{field}{'.' + path if path else ''}: not a JSON schema "
                                f"({e.message})", field) from None


def escape(text: str) -> str:
    """`text` as a literal in outlines-core's regex syntax (Rust's regex crate)."""
    return "".join("\\" + ch if ch in "\\.+*?()|[]{}^$#&-~" else ch for ch in text)


# ------------------------------------------------------------------ the doors' request fields

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}
FIELDS = ("response_format", "structured_outputs") + tuple(GUIDED)   # what from_fields reads


def _structured(value, field: str) -> "Constraint | None":
    """vLLM's structured_outputs: {"json": schema} | {"regex": ...} | {"choice": [...]}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DecodeConfigError(f"{field} must be an object with one of json, regex, choice",
                                field)
    given = [k for k in ("json", "regex", "choice", "json_object") if value.get(k) is not None]
    unknown = sorted(set(k for k, v in value.items() if v is not None) - set(given))
    if unknown:
        raise DecodeConfigError(f"{field}.{unknown[0]} is not supported (json, regex, choice, "
                                f"json_object)", f"{field}.{unknown[0]}")
    if len(given) != 1:
        raise DecodeConfigError(f"{field} takes exactly one of json, regex, choice, json_object; "
                                f"got {given or 'none'}", field)
    return _one(given[0], value[given[0]], f"{field}.{given[0]}")


def _one(kind: str, value, field: str) -> "Constraint":
    return {"json": lambda: Constraint.json_schema(value, field),
            "regex": lambda: Constraint.regex(value, field),
            "choice": lambda: Constraint.choice(value, field),
            "json_object": lambda: Constraint.json_object(field)}[kind]()


def _response_format(value) -> "Constraint | None":
    """OpenAI's response_format: text | json_object | json_schema {name, schema, strict}."""
    field = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object(field)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise DecodeConfigError(f"{field}.json_schema must be an object with a name and a "
                                    f"schema", f"{field}.json_schema")
        if spec.get("schema") is None:
            raise DecodeConfigError(f"{field}.json_schema.schema is required",
                                    f"{field}.json_schema.schema")
        return Constraint.json_schema(spec["schema"], f"{field}.json_schema.schema")
    raise DecodeConfigError(f"{field}.type must be one of text, json_object, json_schema, got "
                            f"{kind!r}", f"{field}.type")


def from_fields(body: dict) -> "Constraint | None":
    """The one constraint a request body asks for (None: none); two at once is an error, and a
    guided_* field this engine does not implement (guided_grammar, guided_decoding_backend, ..)
    is refused by name."""
    for name in body:
        if isinstance(name, str) and name.startswith("guided_") and name not in GUIDED \
                and body[name] is not None:
            raise DecodeConfigError(f"{name} is not supported (supported: {', '.join(GUIDED)}, "
                                    f"response_format, structured_outputs)", name)
    found = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured(body["structured_outputs"],
                                                        "structured_outputs")))
    for name, k in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _one(k, body[name], name)))
    found = [(n, c) for n, c in found if c is not None]
    if len(found) > 1:
        raise DecodeConfigError(f"one constraint per request: {found[0][0]} and {found[1][0]} "
                                f"were both given", found[1][0])
    return found[0][1] if found else None
