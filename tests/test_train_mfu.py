"""MFU is logged only when asked for: a default run never runs the matmul-rate probe and
logs no `mfu`; `log_mfu=true` runs it once and logs model FLOPs / step time / (rate x devices);
a given `peak_flops` is used as the rate without the probe."""

import jax
import pytest

from tests.synthetic import train_data as fixtures
from train import main as main_lib
from train import step as step_lib
from train.config import load_config


def test_mfu_only_when_asked_for(tmp_path, monkeypatch):
    paths = fixtures.make_tiny_setup(str(tmp_path), num_docs=16)
    path = fixtures.write_config(str(tmp_path / "c.yaml"), fixtures.tiny_config_dict(
        paths, **{"steps": 4, "optimizer.lr": 1e-2}))
    calls = []

    def probe(*a, **kw):
        calls.append(1)
        return 2.0e9
    monkeypatch.setattr(step_lib, "measure_matmul_flops", probe)

    plain = main_lib.run(load_config(path), progress=False)["records"]
    assert calls == [] and len(plain) == 4 and not any("mfu" in r for r in plain)

    cfg = load_config(path, ["log_mfu=true"])
    res = main_lib.run(cfg, progress=False)
    asked = res["records"]
    assert calls == [1]
    flops_step = cfg.data.global_batch_size * step_lib.model_flops_per_row(
        res["model_config"], cfg.data.seq_len, cfg.objective.kind, cfg.objective.block_size)
    assert flops_step > 0
    for r in asked:
        assert r["mfu"] == pytest.approx(flops_step / r["step_time_s"] / (2.0e9 * jax.device_count()))

    given = main_lib.run(load_config(path, ["peak_flops=4e9"]), progress=False)["records"]
    assert calls == [1]
    for r in given:
        assert r["mfu"] == pytest.approx(flops_step / r["step_time_s"] / (4.0e9 * jax.device_count()))


def test_no_progress_shows_the_log_every_rows_as_lines(tmp_path, capsys):
    """--no-progress takes the bar away, not the rows: every `log_every`-th step (and the last)
    is one line on stderr, the same steps metrics.jsonl holds."""
    import json
    paths = fixtures.make_tiny_setup(str(tmp_path), num_docs=16)
    path = fixtures.write_config(str(tmp_path / "c.yaml"), fixtures.tiny_config_dict(
        paths, **{"steps": 5, "log_every": 2, "optimizer.lr": 1e-2,
                  "metrics_file": str(tmp_path / "m.jsonl")}))
    assert main_lib.main(["--config", path, "--no-progress"]) == 0
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("train: step ")]
    rows = [json.loads(l) for l in open(tmp_path / "m.jsonl")]
    assert [r["step"] for r in rows] == [2, 4, 5]
    assert [l.split()[2] for l in lines] == ["2/5", "4/5", "5/5"]
    assert all(f"loss {r['loss']:.4f}" in l for r, l in zip(rows, lines))
