"""benchmarks.pareto: a small grid on the demo model, checked against decoding the same
items directly; any checkpoint's "answer" items; bad arguments are one line and exit 2."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import pareto
from decode.config import DecodeConfig
from demo.eval import decode_items, eval_items, load_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "demo", "model")


def test_grid_points_against_direct_decoding(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    items = eval_items(DEMO, "counting", 2)
    with open(tasks, "w") as f:   # the counting items, and their prompts as "answer" items
        for it in items:
            f.write(json.dumps(it) + "\n")
            f.write(json.dumps({"kind": "answer", "prompt": it["prompt"],
                                "answer": it["target"].split(", ")[0]}) + "\n")
    out = str(tmp_path / "p")
    rc = pareto.main(["--kinds", "counting,answer", "--tasks", str(tasks), "--items", "2",
                      "--windows", "4", "--taus", "0.4,0.9", "--repeats", "1", "--out", out])
    assert rc == 0, capsys.readouterr().err
    res = json.load(open(out + ".json"))
    assert res["meta"]["tasks"] == str(tasks)
    points = res["points"]
    assert list(points) == ["ar", "W4 tau0.4 lam0.02", "W4 tau0.9 lam0.02"]
    assert points["ar"]["speedup"] == 1.0
    config, params, tok = load_model(DEMO)
    for name, dc in (("ar", DecodeConfig(method="ar")),
                     ("W4 tau0.9 lam0.02", DecodeConfig(method="streaming", window=4, tau=0.9, lam=0.02))):
        direct = decode_items(params, config, tok, eval_items(str(tasks), "answer"), "answer", dc,
                              warmup=False)
        got = points[name]["kinds"]["answer"]
        assert got["accuracy"] == direct["accuracy"]
        assert got["tokens_per_forward"] == pytest.approx(direct["tokens_per_forward"])
        assert points[name]["speedup"] == pytest.approx(points[name]["tokens_per_s"] /
                                                        points["ar"]["tokens_per_s"])
    assert points["ar"]["tokens_per_forward"] == pytest.approx(1.0)
    table = capsys.readouterr().out
    assert "| W4 tau0.9 lam0.02 |" in table and "counting acc" in table


@pytest.mark.parametrize("argv, message", [
    (["--kinds", "poetry"], "--kinds poetry: known kinds are"),
    (["--tasks", "/nonexistent/t.jsonl"], "/nonexistent/t.jsonl: no such task file"),
    (["--items", "0"], "--items must be >= 1"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert pareto.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_bad_grid_value_names_the_option():
    with pytest.raises(SystemExit) as e:
        pareto.main(["--taus", "0.4,x"])
    assert "--taus takes comma-separated numbers" in str(e.value)
