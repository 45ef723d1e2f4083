"""Exact resume: a wedlm-train run SIGKILLed right after its step-3 checkpoint and restarted
reproduces steps 4-6 of an uninterrupted run (losses within 1e-6, data order included); a
half-written newer checkpoint is set aside in favour of the previous complete one, while a
complete but unreadable one stops the run untouched; the final params export to a Hugging Face folder that a new run can start from (adaptation)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from train import checkpoint as ckpt
from tests.synthetic import train_data as fixtures
from train import main as main_lib
from train import step as step_lib
from train.config import TrainConfigError, load_config


KEYS = ("loss", "mlm_loss", "ar_loss", "grad_norm", "masked_count", "tokens", "lr")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    paths = fixtures.make_tiny_setup(root, num_docs=40)
    cfg = fixtures.tiny_config_dict(paths, **{"checkpoint.every": 3, "checkpoint.keep": 3})
    paths["config"] = fixtures.write_config(os.path.join(root, "cfg.yaml"), cfg)
    return paths


def _table(records):
    return {r["step"]: [r[k] for k in KEYS] for r in records}


# wedlm-train with checkpoint saving wrapped (from outside the package) to block once step 3 is
# committed, so the test can SIGKILL it at a known point
HANG_AT_3 = """
import sys, time
from train import checkpoint as ckpt, main
save = ckpt.save
def save_then_hang(mgr, step, *args, **kw):
    out = save(mgr, step, *args, **kw)
    if step == 3:
        mgr.wait_until_finished()
        print("checkpoint 3 committed", flush=True)
        while True:
            time.sleep(60)
    return out
ckpt.save = save_then_hang
sys.exit(main.main(sys.argv[1:]))
"""


def _killed_run(config, ck_dir, timeout=180):
    """wedlm-train in a subprocess that blocks once checkpoint 3 is committed; SIGKILL it then."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", HANG_AT_3, "--config", config,
                             f"checkpoint.dir={ck_dir}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    lines = []
    try:
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "checkpoint 3 committed" in line:
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "".join(lines[-30:])
    assert any("checkpoint 3 committed" in l for l in lines), "".join(lines[-30:])


def test_sigkill_resume_and_half_written(setup, tmp_path):
    full = main_lib.run(load_config(setup["config"], [f"checkpoint.dir={tmp_path / 'full'}"]),
                        progress=False)
    ref = _table(full["records"])
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]

    ck = str(tmp_path / "killed")
    _killed_run(setup["config"], ck)
    assert ckpt.complete_steps(ck) == [3]
    metrics = [l for l in open(os.path.join(ck, "metrics.jsonl"))]
    assert len(metrics) >= 3  # it ran (and logged) steps 1-3 before the kill

    resumed = main_lib.run(load_config(setup["config"], [f"checkpoint.dir={ck}"]), progress=False)
    assert resumed["start_step"] == 3
    got = _table(resumed["records"])
    assert sorted(got) == [4, 5, 6]
    for s in (4, 5, 6):
        np.testing.assert_allclose(got[s], ref[s], rtol=1e-6, atol=1e-7, err_msg=f"step {s}")
    # the losses do move between steps, so matching them is not trivial
    assert len({round(ref[s][0], 6) for s in (4, 5, 6)}) == 3
    final = jax.device_get(resumed["state"]["params"])
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(jax.device_get(full["state"]["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    # The uninterrupted run saved step 3 asynchronously while steps 4-6 ran on donated buffers:
    # that checkpoint equals the one the killed run committed before blocking.
    mc = full["model_config"]
    cfg = load_config(setup["config"], [f"checkpoint.dir={ck}"])
    opt = step_lib.make_optimizer(cfg)
    from wedlm_jax.sharding import make_mesh
    sh = step_lib.state_shardings(mc, opt, make_mesh(1, 1, 1))
    abstract = step_lib.state_shapes(mc, opt, sh)
    import orbax.checkpoint as ocp
    async3, waited3 = [jax.device_get(ckpt.make_manager(d, every=3, keep=3).restore(
        3, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"])
        for d in (str(tmp_path / "full"), ck)]
    for a, b in zip(jax.tree.leaves(async3), jax.tree.leaves(waited3)):
        np.testing.assert_array_equal(a, b)

    # An unreadable step 12 (commit markers present, array data gone) is an error that names it
    # and renames nothing; a half-written step 9 (no commit markers, part of the state missing)
    # is set aside: with 12 moved away by the user, resume picks step 6.
    shutil.copytree(os.path.join(ck, "6"), os.path.join(ck, "9"))
    os.remove(os.path.join(ck, "9", "commit_success.txt"))
    shutil.rmtree(os.path.join(ck, "9", "state", "d"), ignore_errors=True)
    shutil.copytree(os.path.join(ck, "6"), os.path.join(ck, "12"))
    for sub in os.listdir(os.path.join(ck, "12", "state")):
        if sub.startswith("ocdbt") or sub == "d":
            shutil.rmtree(os.path.join(ck, "12", "state", sub))
    assert ckpt.complete_steps(ck) == [12, 6, 3]
    mgr = ckpt.make_manager(ck, every=3, keep=3)
    before = sorted(os.listdir(ck))
    with pytest.raises(ckpt.ResumeError, match=r"12 is complete but cannot be restored"):
        ckpt.restore_latest(mgr, abstract)
    assert sorted(os.listdir(ck)) == before
    shutil.move(os.path.join(ck, "12"), str(tmp_path / "12-moved-away"))
    mgr.reload()
    step, state, data_state = ckpt.restore_latest(mgr, abstract)
    assert step == 6 and int(state["step"]) == 6
    assert data_state["grain"] == {"next_index": 6}
    for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(final)):
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(ck)) == [".wedlm-train.lock", "3", "6", "9.incomplete",
                                      "metrics.jsonl"]
    # metrics.jsonl: the killed run logged 1-3 (maybe more), the resumed one 4-6, once each
    rows = [json.loads(l)["step"] for l in open(os.path.join(ck, "metrics.jsonl"))]
    assert rows == [1, 2, 3, 4, 5, 6]
    assert ckpt.read_config(ck, 6)["steps"] == 6 and ckpt.read_config(ck, 6)["checkpoint"]["every"] == 3


def test_export_hf_then_adapt_from_it(setup, tmp_path):
    out = str(tmp_path / "hf")
    res = main_lib.run(load_config(setup["config"], ["steps=2", f"checkpoint.export_hf={out}"]),
                       progress=False)
    assert sorted(os.listdir(out))[:3] == ["config.json", "model.safetensors", "tokenizer.json"]
    from wedlm_jax.checkpoints import load_hf_checkpoint
    mc, params = load_hf_checkpoint(out, progress=False)
    assert mc == res["model_config"] and mc.mask_token_id == 1  # the tokenizer's <|mask|>
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(res["state"]["params"]))):
        np.testing.assert_array_equal(a, b)
    # adaptation: start from the HF folder (config, weights and tokenizer from there)
    cfg = load_config(setup["config"], ["model.config=null", f"model.from_hf={out}",
                                        "data.tokenizer=null", "steps=2"])
    adapted = main_lib.run(cfg, progress=False)
    first = adapted["records"][0]
    assert adapted["start_step"] == 0 and np.isfinite(first["loss"])
    # same data, seed and masks as the export run's first step, which started from random
    # weights: the loss differs because the run starts from the exported (trained) weights
    assert first["tokens"] == res["records"][0]["tokens"]
    assert abs(first["loss"] - res["records"][0]["loss"]) > 1e-3
    # the same start from the Orbax folder wedlm-convert writes of that HF folder: same first step
    from wedlm_jax import convert
    orbax = str(tmp_path / "orbax")
    assert convert.main(["hf-to-orbax", "--hf", out, "--out", orbax]) == 0
    cfg = load_config(setup["config"], ["model.config=null", f"model.from_orbax={orbax}",
                                        "data.tokenizer=null", "steps=2"])
    from_orbax = main_lib.run(cfg, progress=False)
    assert from_orbax["model_config"] == adapted["model_config"]
    for key in ("loss", "mlm_loss", "ar_loss", "tokens"):
        assert from_orbax["records"][0][key] == first[key], key
    with pytest.raises(TrainConfigError, match="takes one of model.from_hf, model.from_orbax"):
        load_config(setup["config"], [f"model.from_orbax={orbax}"])   # model.config is set too
