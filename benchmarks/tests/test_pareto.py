"""benchmarks.decoding.pareto: a small grid on a demo-shaped model (conftest.py), checked against decoding
the same items directly; any checkpoint's "answer" items; bad arguments are one line and exit 2."""

from __future__ import annotations

import json

import pytest

from benchmarks.decoding import pareto
from decode.config import DecodeConfig
from demo.eval import decode_items, eval_items, load_model


def write_tasks(path, model, items) -> None:
    """The counting items, and their prompts as "answer" items: the first answered by the model's
    own AR greedy line (right for AR), the others by the count's next number, so the accuracies
    compared below are not all zero."""
    config, params, tok = load_model(model)
    asked = [{"kind": "answer", "prompt": it["prompt"], "answer": ""} for it in items]
    ar = decode_items(params, config, tok, asked[:1], "answer", DecodeConfig(method="ar"),
                      warmup=False)
    answers = [ar["rows"][0]["text"]] + [it["target"].split(", ")[0] for it in items[1:]]
    with open(path, "w") as f:
        for it, q, answer in zip(items, asked, answers):
            f.write(json.dumps(it) + "\n")
            f.write(json.dumps(dict(q, answer=answer)) + "\n")


def test_grid_points_against_direct_decoding(tmp_path, capsys, tiny_demo_model):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, tiny_demo_model, eval_items(tiny_demo_model, "counting", 2))
    out = str(tmp_path / "p")
    rc = pareto.main(["--checkpoint", tiny_demo_model, "--kinds", "counting,answer",
                      "--tasks", str(tasks), "--items", "2",
                      "--windows", "4", "--taus", "0.4,0.9", "--repeats", "1", "--out", out])
    assert rc == 0, capsys.readouterr().err
    res = json.load(open(out + ".json"))
    assert res["meta"]["tasks"] == str(tasks)
    points = res["points"]
    assert list(points) == ["ar", "W4 tau0.4 lam0.02", "W4 tau0.9 lam0.02"]
    assert points["ar"]["speedup"] == 1.0
    config, params, tok = load_model(tiny_demo_model)
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
    assert points["ar"]["kinds"]["answer"]["accuracy"] >= 0.5     # its own line, scored right
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
