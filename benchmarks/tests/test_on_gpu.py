"""benchmarks.gpu.on_gpu at tiny shapes on this CPU (--smoke): the same code paths a GPU runs,
so a device's minutes are not spent finding a bug in the script."""

from __future__ import annotations

import json

from benchmarks.gpu import on_gpu


def test_smoke_run_measures_every_backend_and_step(tmp_path):
    out = tmp_path / "run"
    assert on_gpu.main(["--smoke", "--out", str(out), "--parts", "kernel,kernel_time,qmatmul,steps",
                        "--rounds", "1",
                        "--settings", "ar b8,streaming W16 after b8,ar b8 dense,ar b8 int8"]) == 0
    report = json.loads((out / "on_gpu.json").read_text())
    kernel = report["kernel"]
    assert {r["backend"] for r in kernel} == {"tiled", "cudnn", "pallas", "paged gather",
                                              "paged triton"}
    for r in kernel:
        assert "failed" not in r and not r["nan"], r
        assert r["rel_err"] < (1e-5 if r["dtype"] == "float32" else 1e-2), r
    timed = report["kernel_time"]
    assert len(timed) == 2 * (2 * len(on_gpu.KERNEL_SPLITS) + 1)          # 2 smoke points
    assert all(r["ms_per_layer"] > 0 and "failed" not in r for r in timed), timed
    qm = report["qmatmul"]
    assert len(qm) == 2 and all(r["rel_err"] < 1e-2 and not r["nan"] and r["us"] > 0 for r in qm), qm
    steps = {r["setting"]: r for r in report["steps"]}
    assert set(steps) == {"ar b8", "streaming W16 after b8", "ar b8 dense", "ar b8 int8"}
    assert steps["ar b8 int8"]["quantize"] == "int8"
    # the served cache (here the CPU server's pages of 16; on GPU pages of 64) and the dense one
    assert steps["ar b8"]["page_size"] == 16 and steps["ar b8 dense"]["page_size"] == 0
    for r in steps.values():
        assert r["ms_per_step"] > 0 and len(r["ms_rounds"]) == 1, r
    assert steps["streaming W16 after b8"]["step_over_ar"] > 0


def test_bad_choices_exit_2_before_any_work(tmp_path, capsys):
    assert on_gpu.main(["--out", str(tmp_path / "a")]) == 2            # no GPU here
    assert "needs a GPU" in capsys.readouterr().err
    assert on_gpu.main(["--smoke", "--out", str(tmp_path / "b"), "--parts", "kernel,nope"]) == 2
    assert "unknown part" in capsys.readouterr().err
    assert on_gpu.main(["--smoke", "--out", str(tmp_path / "c"), "--settings", "ar b9"]) == 2
    assert "unknown setting" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_traces_come_back_as_files_of_the_out_folder(tmp_path):
    out = tmp_path / "run"
    assert on_gpu.main(["--smoke", "--out", str(out), "--parts", "steps", "--rounds", "1",
                        "--settings", "ar b8,ar b1", "--trace"]) == 0
    report = json.loads((out / "on_gpu.json").read_text())
    assert [r["trace"] for r in report["steps"]] == ["trace_0.json.gz", "trace_1.json.gz"]
    import gzip
    events = json.load(gzip.open(out / "trace_0.json.gz"))["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)


def test_smoke_run_of_the_next_cards_parts(tmp_path):
    """The default parts (the PyTorch peer in its own process, probes, admission, train, steps)
    at tiny shapes: every figure there, the admission's FLOPs by the hand formula, the targets
    read off the same rows."""
    out = tmp_path / "run"
    assert on_gpu.main(["--smoke", "--out", str(out), "--rounds", "2",
                        "--settings", "ar b1,ar b8"]) == 0
    report = json.loads((out / "on_gpu.json").read_text())
    assert report["card"]["results_folder"].startswith("benchmarks/results/cpu-smoke-")
    assert "jax" in report["card"]["versions"]
    assert list(report["seconds"]) == list(on_gpu.DEFAULT_PARTS)
    # the admission: Qwen3 smoke shape (hidden 64, MLP 128, 1 layer, 4 x 16 query heads, 2 KV
    # heads), 32 prompt rows: (2*64*(64 + 2*32) + 2*64*64 + 6*64*128) * 32 + 4*64 * 32*33/2
    admit = report["admit"]
    assert admit["rows_prefilled"] == 32 and admit["page_size"] == 16     # as served on CPU
    assert admit["rate"] == report["probes"]["bf16_flops"]
    cases = {c["case"]: c for c in admit["cases"]}
    assert set(cases) == {"1 prompt", "8 prompts", "8 prompts, batched"}
    for c in cases.values():
        assert c["model_flops"] == c["prompts"] * 2494464
        assert c["ttft_s"] > c["admission_s"] > 0
        assert c["first_tokens"] and c["first_call_steps"] >= 1
        assert abs(c["mfu"] - c["model_flops"] / c["admission_s"] / admit["rate"]) < 1e-12
        assert len(c["ttft_rounds"]) == 2
    train = [r for r in report["train"] if "step_s" in r]
    assert [r["attention"] for r in report["train"]] == ["tiled"] and train[0]["step_s"] > 0
    assert train[0]["mfu_against"] == admit["rate_from"]
    torch = report["torch_baseline"]
    assert torch["returncode"] == 0 and torch["stage"] == "done" and torch["compile"] == "none"
    for b in ("1", "8"):
        assert torch["batches"][b]["ms_per_step"] > 0 and len(torch["batches"][b]["ms_rounds"]) == 2
        assert len(torch["batches"][b]["first_tokens"]) == 9
    steps = {r["setting"]: r for r in report["steps"]}
    targets = {t["target"]: t for t in report["targets"]}
    assert targets["AR b1 / PyTorch b1"]["value"] == (
        steps["ar b1"]["ms_per_step"] / torch["batches"]["1"]["ms_per_step"])
    assert targets["admission MFU, one 2K prompt"]["value"] == cases["1 prompt"]["mfu"]
    assert all(t["met"] is None for t in targets.values())          # smoke: held to nothing


def test_a_short_budget_skips_parts_and_keeps_what_ran(tmp_path):
    out = tmp_path / "run"
    assert on_gpu.main(["--smoke", "--out", str(out), "--budget-s", "5"]) == 0
    report = json.loads((out / "on_gpu.json").read_text())
    assert report["probes"]["bf16_flops"] > 0
    for part in ("torch_baseline", "qmatmul", "admit", "train"):
        assert report[part] == {"skipped": "time budget"}, part
    assert {r.get("skipped") for r in report["steps"]} == {"time budget"}
    assert len(report["steps"]) == len(on_gpu.STEP_SETTINGS)


def test_the_pytorch_peer_must_run_before_jax_takes_the_card(tmp_path, capsys):
    assert on_gpu.main(["--smoke", "--out", str(tmp_path / "a"),
                        "--parts", "probes,torch_baseline"]) == 2
    assert "runs before the JAX parts" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
