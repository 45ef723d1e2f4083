"""Whether given instances validate against a schema (`jsonschema`, the schema's own draft):
how the audit checks an `enum`'s values against the keywords beside it, and how the oneOf check
finds branches that cannot both hold."""

from __future__ import annotations


def _validator(root, schema, formats: bool):
    import jsonschema
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    checker = cls.FORMAT_CHECKER if formats else None
    return cls(root, format_checker=checker).evolve(schema=schema)


def all_valid(root, schema, values) -> bool:
    """Whether every value validates against `schema` (formats asserted); False when unsure."""
    try:
        v = _validator(root, schema, True)
        return all(v.is_valid(x) for x in values)
    except Exception:                     # noqa: BLE001 (an unresolvable $ref, a bad pattern)
        return False


def none_valid(root, schema, values) -> bool:
    """Whether no value validates against `schema` (formats not asserted); False when unsure."""
    try:
        v = _validator(root, schema, False)
        return not any(v.is_valid(x) for x in values)
    except Exception:                     # noqa: BLE001
        return False
