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
    safe_pattern(pattern) whether a `pattern` is in the subset the tables enforce exactly
    stricter(schema)      where the tables forbid valid instances (`auto` prefers the host there)

A keyword is accepted only where it is known exact (a whitelist per position, found by checking
outlines-core's automaton against `jsonschema`); a keyword that cannot restrict the value there
(`minimum` beside `"type": "string"`, `additionalProperties` beside `properties`, which
outlines-core never extends) is fine. Keywords outside the JSON-schema vocabularies are
annotations. Paths are dotted, from the schema root (`properties.price.minimum`). The device
forbids some valid instances (properties in schema order, no extra properties beside
`properties`, a pattern matched whole, no `\\u` escapes): a stricter output, never a wrong one.

    schema.py       the keyword vocabulary, outlines-core's dispatch, $ref, produced/accepted types
    instances.py    whether given values validate (`jsonschema`)
    patterns.py     safe_pattern
    overlap.py      whether a oneOf's branches are disjoint
    audit.py        unsupported: the per-position whitelist walk
    satisfiable.py  unsatisfiable
    strict.py       stricter
"""

from __future__ import annotations

from decode.constraints.keywords.audit import unsupported
from decode.constraints.keywords.patterns import safe_pattern
from decode.constraints.keywords.satisfiable import unsatisfiable
from decode.constraints.keywords.schema import join
from decode.constraints.keywords.strict import stricter

__all__ = ["check_device", "check_satisfiable", "safe_pattern", "stricter", "unsatisfiable",
           "unsupported"]


def check_satisfiable(schema, field: str) -> None:
    """Raise DecodeConfigError(`field.path: reason`) for the first part of `schema` no instance
    satisfies (refused on every backend: no output could be valid)."""
    _refuse(unsatisfiable(schema), field)


def check_device(schema, field: str) -> None:
    """Raise DecodeConfigError(`field.path: reason`) for the first unsatisfiable or unsupported
    part of `schema`; None when the device tables enforce it exactly."""
    check_satisfiable(schema, field)
    findings = unsupported(schema)
    _refuse(findings[0] if findings else None, field)


def _refuse(found, field: str) -> None:
    if found is None:
        return
    from decode.config import DecodeConfigError
    where = join(field, found[0]) if found[0] else field
    raise DecodeConfigError(f"{where}: {found[1]}", where)
