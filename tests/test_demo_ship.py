"""demo.ship: the shipped folder is built from the runs (continued adaptation runs
included, their steps chained after the first adaptation run) and swapped in whole."""

from __future__ import annotations

import json
import os

import pytest

from demo import ship as demo_ship
from demo.eval import check_model


def _metrics(path, steps, loss):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for s in steps:
            f.write(json.dumps(dict(step=s, loss=loss, ar_loss=loss, mlm_loss=loss + 1, tokens=100,
                                    step_time_s=2.0, includes_compile=s == steps[0])) + "\n")


def _hf(folder, tag):
    os.makedirs(folder, exist_ok=True)
    for name in demo_ship.COPY[:4]:
        with open(os.path.join(folder, name), "w") as f:
            f.write(f"{tag}:{name}")


def _runs(tmp_path):
    runs, data = tmp_path / "runs", tmp_path / "data"
    _metrics(str(runs / "pretrain" / "metrics.jsonl"), [20, 40], 3.0)
    _metrics(str(runs / "adapt" / "metrics.jsonl"), [20, 40, 60], 2.0)
    _hf(str(runs / "adapt" / "hf"), "adapt")
    more = tmp_path / "more"
    _metrics(str(more / "metrics.jsonl"), [10, 20], 1.5)
    _hf(str(more / "hf"), "more")
    os.makedirs(more / "20" / "config")
    cfg = dict(model=dict(from_hf=str(runs / "adapt" / "hf")), data=dict(shuffle_seed=2),
               optimizer=dict(lr=5e-4, final_lr=5e-5, warmup_steps=5), steps=20)
    (more / "20" / "config" / "metadata").write_text(json.dumps(cfg))
    os.makedirs(data)
    (data / "eval.jsonl").write_text('{"kind": "counting", "prompt": "1, ", "target": "2"}\n')
    return runs, data, more


def test_chain_puts_continued_runs_after_the_first():
    rows, starts = demo_ship.chain([[{"step": 20}, {"step": 40}], [{"step": 10}, {"step": 30}]])
    assert [r["step"] for r in rows] == [20, 40, 50, 70]
    assert starts == [40]


def test_ship_continued_run(tmp_path):
    pytest.importorskip("matplotlib")
    runs, data, more = _runs(tmp_path)
    out = tmp_path / "model"
    out.mkdir()
    (out / "README.md").write_text("card")
    (out / "stale.bin").write_text("old")
    assert demo_ship.main(["--runs", str(runs), "--data", str(data), "--out", str(out),
                           "--continued", str(more)]) == 0
    check_model(str(out))  # the manifest covers what was written
    assert (out / "README.md").read_text() == "card"  # the card is kept
    assert not (out / "stale.bin").exists()  # the folder was replaced whole
    assert (out / "model.safetensors").read_text() == "more:model.safetensors"  # the last run is shipped
    info = json.loads((out / "training.json").read_text())
    assert info["adapt"]["steps"] == 60
    (cont,) = info["adapt_continued"]
    assert (cont["steps"], cont["lr"], cont["shuffle_seed"]) == (20, 5e-4, 2)
    assert cont["from_hf"].endswith(os.path.join("adapt", "hf"))
    assert (out / "metrics_adapt_more1.jsonl").exists()
    assert not list(tmp_path.glob(".demo_model.*"))  # no temporary folder left behind


def test_ship_refuses_a_run_without_export_and_keeps_the_old_folder(tmp_path):
    runs, data, more = _runs(tmp_path)
    os.remove(more / "hf" / "model.safetensors")
    out = tmp_path / "model"
    out.mkdir()
    (out / "README.md").write_text("card")
    with pytest.raises(SystemExit, match="model.safetensors is missing"):
        demo_ship.main(["--runs", str(runs), "--data", str(data), "--out", str(out), "--continued", str(more)])
    assert (out / "README.md").read_text() == "card"
