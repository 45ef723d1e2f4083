"""wedlm-train refuses instead of clobbering: a resume whose config differs in meaning
stops before touching anything and lists the keys; a run whose final checkpoint exists says so and
exits 0; extending `steps` resumes; `checkpoint.resume=false` starts fresh with the old steps moved
aside; metrics.jsonl holds each step once after a resume; one run per checkpoint folder (an flock
held by a second, real process blocks it); `checkpoint.export_hf` is checked before any work."""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from train import checkpoint as ckpt
from tests.synthetic import train_data as fixtures
from train import main as main_lib
from train.config import TrainConfigError, load_config



@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step run with checkpoints at steps 3 and 6 (the template every test copies; the same
    config as test_train_resume's, so the compiled step comes from the compilation cache)."""
    root = str(tmp_path_factory.mktemp("guards"))
    paths = fixtures.make_tiny_setup(root, num_docs=40)
    cfg = fixtures.tiny_config_dict(paths, **{"checkpoint.every": 3, "checkpoint.keep": 3})
    paths["config"] = fixtures.write_config(os.path.join(root, "cfg.yaml"), cfg)
    paths["ck"] = os.path.join(root, "ck")
    assert main_lib.main(["--config", paths["config"], f"checkpoint.dir={paths['ck']}"]) == 0
    assert ckpt.complete_steps(paths["ck"]) == [6, 3]
    return paths


def _snapshot(folder):
    return sorted((os.path.relpath(os.path.join(dp, f), folder),
                   os.path.getmtime(os.path.join(dp, f))) for dp, _, fs in os.walk(folder)
                  for f in fs if f != ckpt.LOCK_NAME)


def _steps(folder):
    return [json.loads(l)["step"] for l in open(os.path.join(folder, "metrics.jsonl"))]


def _copy(trained, tmp_path, name="ck"):
    dst = str(tmp_path / name)
    shutil.copytree(trained["ck"], dst)
    return dst


@pytest.mark.parametrize("overrides,keys", [
    (["steps=8", "model.config.hidden_size=64"], ["model.config.hidden_size: 32 -> 64"]),
    (["objective.kind=plain"], ["objective.kind: 'dual_stream' -> 'plain'"]),
    (["data.global_batch_size=16", "optimizer.lr=1e-3"],
     ["data.global_batch_size: 8 -> 16", "optimizer.lr: 0.003 -> 0.001"]),
])
def test_changed_config_stops_before_touching(trained, tmp_path, capsys, overrides, keys):
    ck = _copy(trained, tmp_path)
    before = _snapshot(ck)
    rc = main_lib.main(["--config", trained["config"], f"checkpoint.dir={ck}", *overrides])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"wedlm-train: error: checkpoint.dir {ck} holds step 6 of a run with a "
                          f"different config"), err
    for k in keys:
        assert k in err, err
    assert "checkpoint.resume=false" in err and "new checkpoint.dir" in err and "steps" in err
    assert _snapshot(ck) == before  # nothing renamed, nothing written


def test_final_checkpoint_present_and_past_steps(trained, tmp_path, capsys):
    ck = _copy(trained, tmp_path)
    before = _snapshot(ck)
    assert main_lib.main(["--config", trained["config"], f"checkpoint.dir={ck}"]) == 0
    out = capsys.readouterr().out
    assert "already holds the final checkpoint (step 6)" in out and "nothing to train" in out
    assert _snapshot(ck) == before
    assert main_lib.main(["--config", trained["config"], f"checkpoint.dir={ck}", "steps=5"]) == 2
    assert "already holds step 6, past steps=5" in capsys.readouterr().err


def test_extend_steps_and_metrics_once_per_step(trained, tmp_path):
    # extending steps passes the check and resumes from the final checkpoint (the resume itself
    # is the one exercised below; a new `steps` would only cost a compilation here)
    for steps in (7, 100):
        cfg = load_config(trained["config"], [f"checkpoint.dir={trained['ck']}", f"steps={steps}"])
        assert ckpt.check_resume(trained["ck"], cfg.to_dict()) == 6
    # resuming from step 3 after steps 4-6 were logged (their checkpoint lost): rows 4-6 are
    # replaced, not repeated
    ck2 = _copy(trained, tmp_path, "ck2")
    shutil.rmtree(os.path.join(ck2, "6"))
    assert _steps(ck2) == [1, 2, 3, 4, 5, 6]
    res = main_lib.run(load_config(trained["config"], [f"checkpoint.dir={ck2}"]), progress=False)
    assert res["start_step"] == 3
    assert _steps(ck2) == [1, 2, 3, 4, 5, 6]
    redone = {json.loads(l)["step"]: json.loads(l) for l in open(os.path.join(ck2, "metrics.jsonl"))}
    np.testing.assert_allclose(redone[6]["loss"], res["records"][-1]["loss"])


def test_resume_false_starts_fresh_and_keeps_the_old_steps(trained, tmp_path):
    ck = _copy(trained, tmp_path)
    old6 = _snapshot(os.path.join(ck, "6"))
    res = main_lib.run(load_config(trained["config"], [f"checkpoint.dir={ck}",
                                                       "checkpoint.resume=false"]), progress=False)
    assert res["start_step"] == 0 and len(res["records"]) == 6
    prev = [n for n in os.listdir(ck) if n.startswith("previous-")]
    assert len(prev) == 1
    assert sorted(os.listdir(os.path.join(ck, prev[0]))) == ["3", "6", "metrics.jsonl"]
    assert _snapshot(os.path.join(ck, prev[0], "6")) == old6
    assert ckpt.complete_steps(ck) == [6, 3] and _steps(ck) == [1, 2, 3, 4, 5, 6]


LOCKER = """
import sys, time
from train.checkpoint import lock_run_dir
f = lock_run_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_one_run_per_folder(trained, tmp_path):
    ck = str(tmp_path / "locked")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    holder = subprocess.Popen([sys.executable, "-c", LOCKER, ck], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        second = subprocess.run([sys.executable, "-m", "train.main", "--config", trained["config"],
                                 f"checkpoint.dir={ck}"], env=env, capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert (f"checkpoint.dir {ck} is in use by another wedlm-train run (pid {holder.pid}"
                in second.stderr), second.stderr[-2000:]
        assert sorted(os.listdir(ck)) == [".wedlm-train.lock"]  # the second run wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    # the kernel released the dead holder's lock: the folder can be locked again
    f = ckpt.lock_run_dir(ck)
    assert open(os.path.join(ck, ckpt.LOCK_NAME)).read().strip() == str(os.getpid())
    f.close()


def _hf_folder(trained, path):
    from wedlm_jax import model
    from wedlm_jax.checkpoints import save_hf_checkpoint
    from wedlm_jax.config import ModelConfig
    mc = ModelConfig(**fixtures.TINY_MODEL)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32),
                          model.param_shapes(mc))
    save_hf_checkpoint(mc, params, path, tokenizer_from=trained["tokenizer"], progress=False)
    for name in ("README.md", "generation_config.json"):
        with open(os.path.join(path, name), "w") as f:
            f.write("{}\n")
    return path


def test_export_hf_checked_before_any_work(trained, tmp_path, capsys):
    src = _hf_folder(trained, str(tmp_path / "src"))
    before = _snapshot(src)
    ck = str(tmp_path / "ck")
    adapt = ["--config", trained["config"], "model.config=null", f"model.from_hf={src}",
             "data.tokenizer=null", f"checkpoint.dir={ck}"]
    assert main_lib.main([*adapt, f"checkpoint.export_hf={src}", "--force"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.export_hf {src} is model.from_hf" in err, err
    assert main_lib.main([*adapt, f"checkpoint.export_hf={tmp_path}"]) == 2
    assert f"checkpoint.export_hf {tmp_path} contains model.from_hf" in capsys.readouterr().err
    assert _snapshot(src) == before

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    assert main_lib.main([*adapt, f"checkpoint.export_hf={notes}", "--force"]) == 2
    assert "is not empty and holds no checkpoint" in capsys.readouterr().err
    other = shutil.copytree(src, str(tmp_path / "other"))
    assert main_lib.main([*adapt, f"checkpoint.export_hf={other}"]) == 2
    err = capsys.readouterr().err
    assert "already holds a checkpoint; pass --force (checkpoint.export_force=true)" in err, err
    assert not os.path.exists(ck)  # refused before the checkpoint folder was even created
    # with --force the guard lets an existing checkpoint be replaced
    main_lib.check_outputs(load_config(trained["config"], [f"checkpoint.export_hf={other}",
                                                           "checkpoint.export_force=true"]))


def test_small_config_faults(trained, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    assert main_lib.main(["--config", trained["config"], f"checkpoint.dir={afile}"]) == 2
    assert f"checkpoint.dir {afile}: exists and is not a folder" in capsys.readouterr().err
    with pytest.raises(TrainConfigError, match=r"objective.block_size \(64\) exceeds data.seq_len "
                                               r"\(32\)"):
        load_config(trained["config"], ["objective.block_size=64"])
    load_config(trained["config"], ["objective.block_size=64", "objective.kind=ar_only"])
    with pytest.raises(TrainConfigError, match=r"^override 'steps=abc': steps must be an integer"):
        load_config(trained["config"], ["steps=abc"])
    with pytest.raises(TrainConfigError, match=r"^override 'optimizer.lr=x': optimizer.lr must be"):
        load_config(trained["config"], ["optimizer.lr=x"])


def test_truncate_metrics_is_atomic_and_keeps_earlier_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (1, 2, 3, 4))
                    + '{"step": 5, "lo')  # a torn last line of a killed run
    assert ckpt.truncate_metrics(str(path), 2) == 3
    assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no temp file left


def test_meaning_diff_keys():
    from train.config import TrainConfig
    saved = {"steps": 6, "seed": 0, "objective": {"kind": "plain", "eps": 0.001},
             "checkpoint": {"every": 3}, "mesh": {"data": 2}, "model": {"config": {"h": 32}},
             "old_knob": 1}
    req = {"steps": 9, "seed": 0, "objective": {"kind": "plain", "eps": 0.001},
           "checkpoint": {"every": 5}, "mesh": {"data": 4}, "model": {"config": {"h": 32}},
           "remat": True, "compute_dtype": "bfloat16"}
    # steps, checkpoint.*, mesh.*, remat: no change in meaning; old_knob is gone from the code;
    # compute_dtype is new to the saved config but at its default
    assert TrainConfig().compute_dtype == "bfloat16"
    assert ckpt.meaning_diff(saved, req, TrainConfig().to_dict()) == []
    req = {**req, "seed": 1, "compute_dtype": "float32", "model": {"config": {"h": 64}}}
    assert ckpt.meaning_diff(saved, req, TrainConfig().to_dict()) == [
        ("compute_dtype", None, "float32"), ("model.config.h", 32, 64), ("seed", 0, 1)]
