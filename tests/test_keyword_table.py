"""The keyword table of docs/structured-outputs.md (decode/constraints/table.py): regenerated from
both backends' own checks it equals the doc's, and a few cells say what the backends are known to
do. jax-free."""

from __future__ import annotations

import os

import jsonschema
import pytest

from decode.constraints import table

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "structured-outputs.md")


@pytest.fixture(scope="module")
def rows():
    tokenizer = table.demo_tokenizer()
    return tokenizer, {name: (device, host) for name, _, device, host in table.rows(tokenizer)}


def test_doc_holds_the_current_table(rows):
    tokenizer, _ = rows
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    assert table.splice(text, table.markdown(tokenizer)) == text, (
        "docs/structured-outputs.md's keyword table is stale: run "
        "`python -m decode.constraints.table --write docs/structured-outputs.md`")


@pytest.mark.parametrize("name, device, host", [
    ("minimum", "refused (minimum: not enforced by the device tables)", "enforced"),
    ("uniqueItems", "refused (uniqueItems: not enforced by the device tables)",
     "refused (uniqueItems: not supported)"),
    ("properties", "enforced", "enforced"),
    ("oneOf (disjoint)", "enforced", "enforced"),
    ("allOf (several)", "refused (allOf: allOf of more than one schema is not enforced by the "
     "device tables)", "enforced"),
    ("format: uuid", "enforced", "enforced"),
])
def test_known_cells(rows, name, device, host):
    assert rows[1][name] == (device, host)


def test_probes_are_valid_distinct_schemas():
    names = [name for name, _ in table.PROBES]
    assert len(set(names)) == len(names)
    for name, schema in table.PROBES:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_splice_replaces_only_between_the_markers():
    text = f"before\n{table.BEGIN}\nold\n{table.END}\nafter\n"
    assert table.splice(text, "new") == f"before\n{table.BEGIN}\nnew\n{table.END}\nafter\n"
    with pytest.raises(ValueError):
        table.splice("no markers", "new")


def test_the_formats_paragraph_agrees_with_the_table(rows):
    """The prose names formats the host enforces and formats refused everywhere: each as the
    table (regenerated from the backends) says."""
    import re
    text = open(DOC, encoding="utf-8").read()
    para = text[text.index("A format the device tables"):text.index("refused by name on every backend")]
    enforced_part, refused_part = para.split("one neither enforces")
    table_rows = rows[1]
    for part, host_enforces in ((enforced_part, True), (refused_part, False)):
        names = re.findall(r"`([a-z0-9-]+)`", re.search(r"\(([^)]*)\)", part).group(1))
        assert names, part
        for name in names:
            device, host = table_rows[f"format: {name}"]
            assert device.startswith("refused"), name
            assert (host == "enforced") is host_enforces, (name, host)
