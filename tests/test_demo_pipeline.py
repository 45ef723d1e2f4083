"""The demo pipeline end to end at toy size on this CPU (the same stages and programs as the GPU
target: it proves the pipeline, not the model), its refusals, shipping its model folder, the
parallel packer it uses, and the train program's time limit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from demo import pipeline, ship
from demo.eval import check_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2 ** 20


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline") / "run"
    r = subprocess.run([sys.executable, "-m", "demo.pipeline", "--target", "toy", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def test_model_folder_is_what_a_card_can_send_back(run):
    out, _ = run
    model = out / "model"
    names = sorted(os.listdir(model))
    sizes = [os.path.getsize(model / n) for n in names]
    assert len(names) <= 8 and max(sizes) <= 16 * MiB and sum(sizes) <= 64 * MiB
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "report.json"} <= set(names)
    from wedlm_jax.safetensors_io import index_tensors, read_tensor
    shipped, trained = index_tensors(str(model)), index_tensors(str(out / "adapt" / "hf"))
    assert shipped.keys() == trained.keys()
    for k in shipped:      # the adapted weights, rounded to bf16 and nothing else
        got = read_tensor(shipped[k])
        assert got.dtype.name == "bfloat16", k
        want = read_tensor(trained[k]).astype(got.dtype)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), k


def test_report_holds_every_stage_and_both_readings(run):
    out, proc = run
    report = json.load(open(out / "model" / "report.json"))
    assert list(report["stage_seconds"]) == ["data", "pack", "pretrain", "convert", "adapt",
                                             "package", "heldout"]
    assert all(v > 0 for v in report["stage_seconds"].values())
    pre, ada = report["stages"]["pretrain"], report["stages"]["adapt"]
    assert pre["metrics"][-1]["step"] == 12 and ada["metrics"][-1]["step"] == report["adapt_steps"] == 8
    assert 0 < pre["final"]["ar_accuracy"] <= 1 and pre["final"]["masked_accuracy"] == 0
    assert 0 < ada["final"]["ar_accuracy"] <= 1 and 0 < ada["final"]["masked_accuracy"] <= 1
    assert pre["settings"]["objective"]["kind"] == "ar_only"
    assert ada["settings"]["model"]["from_hf"].endswith("hf_roundtrip")
    regimes = report["heldout"]["regimes"]
    assert set(regimes) == {"counting", "arith", "lists", "records", "code"}
    for kind, runs in regimes.items():
        assert runs["verified_equals_ar"] == "2/2", kind      # verified commits are AR's tokens
        assert runs["ar"]["tokens_per_forward"] == 1.0
        sweep = runs["streaming_sweep"]                      # stricter streaming settings
        assert list(sweep) == ["tau=0.3,lam=0.05", "tau=0.2,lam=0.05", "tau=0.3,lam=0.1"], kind
        assert all(r["items"] == 2 and r["tokens_per_forward"] > 0 for r in sweep.values())
    kinds = {e["kind"] for e in report["eval_items"]}
    assert kinds == set(regimes)
    assert "verified = AR on 2/2 items" in proc.stdout
    assert "streaming at stricter settings" in proc.stdout


def test_refuses_a_foreign_or_earlier_folder(run, tmp_path):
    foreign = tmp_path / "runs"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    args = [sys.executable, "-m", "demo.pipeline", "--target", "toy", "--out"]
    r = subprocess.run(args + [str(foreign)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{foreign} exists and was not made by this pipeline" in r.stderr
    assert os.listdir(foreign) == ["keep.txt"] and len(r.stderr.strip().splitlines()) == 1
    out, _ = run
    r = subprocess.run(args + [str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pass --force" in r.stderr
    assert (out / "model" / "report.json").exists()


def test_round_trip_check_names_a_changed_tensor(run, tmp_path):
    out, _ = run
    copy = tmp_path / "hf"
    shutil.copytree(out / "pretrain" / "hf", copy)
    pipeline.same_checkpoint(str(out / "pretrain" / "hf"), str(copy))
    from wedlm_jax.safetensors_io import index_tensors
    info = next(iter(index_tensors(str(copy)).values()))
    with open(info.file, "r+b") as f:
        f.seek(info.start)
        byte = f.read(1)
        f.seek(info.start)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(pipeline.PipelineError, match="round trip changed"):
        pipeline.same_checkpoint(str(out / "pretrain" / "hf"), str(copy))


def test_ship_makes_a_checked_demo_folder(run, tmp_path):
    out, _ = run
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "README.md").write_text("card")
    info = ship.ship(str(out / "model"), str(dst))
    check_model(str(dst))
    assert (dst / "README.md").read_text() == "card"
    assert {"eval.jsonl", "loss_pretrain.png", "loss_adapt.png", "training.json",
            "metrics_adapt.jsonl"} <= set(os.listdir(dst))
    assert info["stages"]["adapt"]["steps"] == 8 and "report.json" not in os.listdir(dst)
    bad = tmp_path / "bad"          # a run without weights: named, the shipped folder kept
    shutil.copytree(out / "model", bad)
    for n in os.listdir(bad):
        if n.endswith(".safetensors"):
            os.remove(bad / n)
    with pytest.raises(ship.ShipError, match="no .safetensors file"):
        ship.ship(str(bad), str(dst))
    check_model(str(dst))
    os.remove(bad / "config.json")
    with pytest.raises(ship.ShipError, match="bad/config.json is missing"):
        ship.check_run(str(bad))


def test_parallel_packing_keeps_every_document(run, tmp_path):
    """train.data.pretokenize --workers 2 packs the same documents as one worker (rows differ)."""
    from train.data.pipeline import open_packed
    from train.data.pretokenize import pretokenize
    out, _ = run
    data = out / "data"

    def documents(folder):
        rows = open_packed(str(folder))
        docs = []
        for i in range(len(rows["tokens"])):
            t, s = np.asarray(rows["tokens"][i]), np.asarray(rows["segment_ids"][i])
            docs += [tuple(t[s == k]) for k in range(1, int(s.max()) + 1)]
        return sorted(docs)

    one = tmp_path / "one"
    meta = pretokenize([str(data / "train.jsonl")], str(data / "tokenizer"), str(one), 128)
    two = json.load(open(data / "packed" / "meta.json"))
    assert two["lines"] == meta["lines"] and "worker" in two["document_order"]
    assert documents(one) == documents(data / "packed")


def test_train_time_limit_saves_and_exports_where_it_stops(run, tmp_path):
    out, _ = run
    d = tmp_path / "limited"
    r = subprocess.run(
        [sys.executable, "-m", "train.main", "--config", "configs/demo_pretrain.yaml", "--no-progress",
         f"data.packed_dir={out / 'data' / 'packed'}", f"data.tokenizer={out / 'data' / 'tokenizer'}",
         f"checkpoint.dir={d}", f"checkpoint.export_hf={d / 'hf'}", *pipeline.TINY_MODEL,
         "data.seq_len=128", "data.global_batch_size=4", "compute_dtype=f32", "steps=50",
         "log_every=2", "time_limit_s=0.001", "optimizer.warmup_steps=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stopping at step 2 of 50: time_limit_s=0.001 reached" in r.stderr
    rows = [json.loads(x) for x in open(d / "metrics.jsonl")]
    assert rows[-1]["step"] == 2 and os.path.isdir(d / "2") and (d / "hf" / "config.json").exists()
    assert "absl" not in r.stderr          # library INFO lines only with --verbose
