"""Where the device tables are stricter than a schema: valid instances they forbid (a narrower
output, never a wrong one). `auto` sends such schemas to the host parser, which allows them.

    stricter(schema)  the dotted paths of objects with `properties` that allow other properties
                      (`additionalProperties` absent, true or a schema): the tables emit the
                      listed properties only
"""

from __future__ import annotations


def stricter(schema, path: str = "") -> list:
    """Paths (dotted, from the root) where the tables forbid what the schema allows."""
    out = []
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict) and \
                schema.get("additionalProperties", True) is not False:
            out.append(path)
        for k, v in schema.items():
            out += stricter(v, f"{path}.{k}" if path else str(k))
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            out += stricter(v, f"{path}.{i}" if path else str(i))
    return out
