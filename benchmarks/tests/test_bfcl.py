"""benchmarks.structured.bfcl: BFCL's types as JSON Schema, the AST match on hand-made calls (ones that
pass and ones that must fail), bad input refused with exit 2, and an end-to-end run of the demo
model's stand-in (benchmarks/tests/conftest.py: the demo's tokenizer and layout, tiny random
weights, so programs compile in seconds) on a tiny data folder written here in BFCL's format
(the bfcl-eval wheel is not needed)."""

from __future__ import annotations

import json

import pytest

from benchmarks.structured import bfcl
from demo.eval import DEMO_MODEL

AREA = {"name": "area", "description": "the area of a shape", "parameters": {
    "type": "dict", "properties": {
        "base": {"type": "integer"}, "height": {"type": "float"},
        "unit": {"type": "string", "description": "default 'cm'"},
        "exact": {"type": "boolean"}},
    "required": ["base", "height"]}}
PLOT = {"name": "plot.points", "parameters": {"type": "dict", "properties": {
    "points": {"type": "array", "items": {"type": "float"}},
    "style": {"type": "dict", "properties": {"color": {"type": "string"},
                                             "width": {"type": "integer"}}},
    "labels": {"type": "array", "items": {"type": "string"}}},
    "required": ["points"]}}
AREA_TRUTH = {"area": {"base": [10], "height": [5.0], "unit": ["cm", ""], "exact": ["", True]}}


def test_types_become_json_schema():
    schema = bfcl.to_schema({"type": "dict", "properties": {
        "x": {"type": "float", "description": "x", "default": 1.5},
        "pair": {"type": "tuple", "items": {"type": "integer"}},
        "what": {"type": "any", "description": "anything"},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "opts": {"type": "dict", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
        "xs": {"type": "array", "items": {"type": "dict", "properties": {}}}},
        "required": ["x"], "optional": ["pair"]})
    assert schema == {"type": "object", "required": ["x"], "additionalProperties": False,
                      "properties": {
        "x": {"type": "number", "description": "x", "default": 1.5},
        "pair": {"type": "array", "items": {"type": "integer"}},
        "what": {"description": "anything"},
        "mode": {"type": "string", "enum": ["a", "b"]},
        "opts": {"type": "object", "properties": {"on": {"type": "boolean"}},
                 "required": ["on"], "additionalProperties": False},
        "xs": {"type": "array", "items": {"type": "object", "properties": {},
                                          "additionalProperties": False}}}}
    with pytest.raises(bfcl.InputError, match="frob"):
        bfcl.to_schema({"type": "frob"})


@pytest.mark.parametrize("args, ok", [
    ({"base": 10, "height": 5.0}, True),                        # optional ones absent
    ({"base": 10, "height": 5}, True),                          # an int is a float
    ({"base": 10, "height": 5.0, "unit": " CM"}, True),         # strings standardized
    ({"base": 10, "height": 5.0, "exact": True}, True),
    ({"base": 11, "height": 5.0}, False),                       # a wrong value
    ({"base": 10.0, "height": 5.0}, False),                     # a float is not an integer
    ({"height": 5.0}, False),                                   # a required one missing
    ({"base": 10, "height": 5.0, "unit": "mm"}, False),
    ({"base": 10, "height": 5.0, "exact": 1}, False),           # 1 is not a boolean
    ({"base": 10, "height": 5.0, "colour": "red"}, False),      # not declared
])
def test_ast_simple(args, ok):
    assert bfcl.ast_match([AREA], [("area", args)], [AREA_TRUTH], parallel=False) is ok


def test_ast_names_counts_and_missing_answers():
    good = ("area", {"base": 10, "height": 5.0})
    assert not bfcl.ast_match([AREA], [("volume", good[1])], [AREA_TRUTH], False)
    assert not bfcl.ast_match([AREA], [good, good], [AREA_TRUTH], False)
    assert not bfcl.ast_match([AREA], [], [AREA_TRUTH], False)
    strict = {"area": {"base": [10], "height": [5.0], "unit": ["cm"]}}  # unit not optional
    assert not bfcl.ast_match([AREA], [good], [strict], False)
    assert bfcl.ast_match([AREA], [("area", {**good[1], "unit": "cm"})], [strict], False)


def test_ast_lists_dicts_and_parallel_order():
    truth = {"plot.points": {"points": [[1.0, 2.5]], "labels": [["New York", "Oslo"], ""],
                             "style": [{"color": ["red"], "width": [2, ""]}, ""]}}
    docs = [PLOT, AREA]
    call = ("plot.points", {"points": [1.0, 2.5], "labels": ["new york", "oslo"],
                            "style": {"color": "Red"}})
    assert bfcl.ast_match(docs, [call], [truth], False)
    for bad in ({"points": [2.5, 1.0]}, {"points": [1.0, 2.5], "labels": ["Oslo"]},
                {"points": [1.0, 2.5], "style": {"color": "red", "dash": 1}},
                {"points": [1.0, 2.5], "style": {"width": 2}}):
        assert not bfcl.ast_match(docs, [("plot.points", bad)], [truth], False), bad
    area = ("area", {"base": 10, "height": 5.0})
    assert bfcl.ast_match(docs, [area, call], [truth, AREA_TRUTH], parallel=True)
    assert not bfcl.ast_match(docs, [area, area], [truth, AREA_TRUTH], parallel=True)
    assert not bfcl.ast_match(docs, [area], [truth, AREA_TRUTH], parallel=True)


WEATHER = {"name": "weather.get", "description": "the weather in a city", "parameters": {
    "type": "dict", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                   "metric": {"type": "boolean"}}, "required": ["city"]}}
TIME = {"name": "time_now", "description": "the time in a zone", "parameters": {
    "type": "dict", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}


def _example(name: str, i: int) -> tuple:
    ask = [[{"role": "user", "content": f"Weather in Oslo and the time in UTC? ({i})"}]]
    functions = [WEATHER] if name in ("simple_python", "parallel", "irrelevance") \
        else [WEATHER, TIME]
    truth = [{"weather.get": {"city": ["Oslo"], "metric": ["", True]}}]
    if name.startswith("parallel"):
        truth.append({"time_now": {"zone": ["UTC"]}} if name == "parallel_multiple"
                     else {"weather.get": {"city": ["Paris"], "metric": [""]}})
    ex = {"id": f"{name}_{i}", "question": ask, "function": functions}
    return ex, {"id": ex["id"], "ground_truth": truth}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Three examples per set in BFCL's layout (bfcl_eval/data/...)."""
    root = tmp_path_factory.mktemp("bfcl")
    (root / "possible_answer").mkdir()
    for name in bfcl.SETS:
        pairs = [_example(name, i) for i in range(3)]
        (root / f"BFCL_v4_{name}.json").write_text(
            "".join(json.dumps(e) + "\n" for e, _ in pairs))
        if name != "irrelevance":
            (root / "possible_answer" / f"BFCL_v4_{name}.json").write_text(
                "".join(json.dumps(a) + "\n" for _, a in pairs))
    return str(root)


def test_end_to_end_on_the_demo_model(tiny_demo_model, data, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bfcl.main(["--checkpoint", tiny_demo_model, "--data", data, "--limit", "2",
                    "--method", "streaming", "--window", "8", "--max-new-tokens", "64",
                    "--batch", "2", "--capacity", "512", "--out", str(out)])
    assert rc == 0
    assert "parallel_multiple" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert {"command", "date", "machine", "method", "window", "sets", "wall_s"} <= set(report)
    assert [s["set"] for s in report["sets"]] == list(bfcl.SETS)
    for s in report["sets"]:
        assert {"examples", "valid_pct", "malformed", "cut", "ast_pct", "tokens_per_forward",
                "tokens_per_forward_free", "wall_s", "refused"} <= set(s)
        assert s["examples"] == 2 and not s["refused"], s["refused"]
        assert s["valid_pct"] == 100.0 and s["malformed"] == 0 and s["cut"] == 0, s["outputs"]
        assert s["tokens_per_forward"] > 0 and s["tokens_per_forward_free"] > 0
    assert report["sets"][-1]["tool_choice"] == "auto"


@pytest.mark.parametrize("argv, words", [
    (["--sets", "simple_java"], "unknown set simple_java"),
    (["--checkpoint", "/nonexistent"], "no such folder"),
    (["--data", "/nonexistent"], "neither the bfcl-eval wheel nor a folder"),
    (["--data", "."], "BFCL_v4_simple_python.json is not in the data"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    base = {"--checkpoint": DEMO_MODEL, "--data": "."}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    rc = bfcl.main([x for kv in base.items() for x in kv])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and err.count("\n") == 1, err
