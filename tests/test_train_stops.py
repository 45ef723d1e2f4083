"""How a training run ends early (train/loop.py): SIGTERM mid-run saves the step in flight and a
rerun resumes it exactly; a non-finite loss stops the run naming the step with no checkpoint past
it (or, with nonfinite_skips, skips that many updates first); absurd config numbers are refused
before the model loads."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.synthetic import train_data as fixtures
from train import checkpoint as ckpt
from train import main as main_lib
from train.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("loss", "mlm_loss", "ar_loss", "grad_norm", "masked_count", "tokens", "lr")

# wedlm-train whose process receives SIGTERM once its third step is dispatched (a preemption
# notice at a known point: the signal is real, only its timing is fixed)
TERM_AT_3 = """
import os, signal, sys
from train import main, step
make = step.make_train_step
def make_then_term(*a, **kw):
    fn, calls = make(*a, **kw), [0]
    def run(state, batch):
        out = fn(state, batch)
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    return run
step.make_train_step = make_then_term
sys.exit(main.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("stops"))
    paths = fixtures.make_tiny_setup(root, num_docs=40)
    cfg = fixtures.tiny_config_dict(paths, **{"checkpoint.every": 100})
    paths["config"] = fixtures.write_config(os.path.join(root, "cfg.yaml"), cfg)
    return paths


def _train(args, code=None, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "train.main", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _table(records):
    return {r["step"]: [r[k] for k in KEYS] for r in records}


def test_sigterm_saves_the_step_in_flight_and_a_rerun_resumes_exactly(setup, tmp_path):
    full = main_lib.run(load_config(setup["config"], [f"checkpoint.dir={tmp_path / 'full'}"]),
                        progress=False)
    ck = str(tmp_path / "preempted")
    r = _train(["--config", setup["config"], f"checkpoint.dir={ck}"], TERM_AT_3)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"wedlm-train: stopped by SIGTERM at step 3 of 6; saved the checkpoint of "
                    f"step 3 in {ck}; rerun the same command to resume")
    assert ckpt.complete_steps(ck) == [3]                    # every=100: saved for the signal
    resumed = main_lib.run(load_config(setup["config"], [f"checkpoint.dir={ck}"]), progress=False)
    assert resumed["start_step"] == 3 and resumed["stopped"] == "done"
    ref, got = _table(full["records"]), _table(resumed["records"])
    assert sorted(got) == [4, 5, 6]
    for s in (4, 5, 6):
        np.testing.assert_allclose(got[s], ref[s], rtol=1e-6, atol=1e-7, err_msg=f"step {s}")
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed["state"]["params"])),
                    jax.tree.leaves(jax.device_get(full["state"]["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_diverging_run_stops_at_the_step_and_saves_nothing_past_it(setup, tmp_path):
    ck = tmp_path / "diverged"
    r = _train(["--config", setup["config"], f"checkpoint.dir={ck}", "checkpoint.every=1",
                "optimizer.lr=1e30", "optimizer.clip=0", "steps=6"])
    assert r.returncode == 1, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    bad = int(line.split("step ")[1].split(":")[0])
    assert line.startswith(f"wedlm-train: error: step {bad}: the loss is ") and "nonfinite_skips" in line
    assert "free space" not in line and line.endswith("; rerun with that changed to resume"), line
    rows = [json.loads(x) for x in open(ck / "metrics.jsonl")]
    saved = ckpt.complete_steps(str(ck))
    assert all(s < bad for s in saved), (saved, bad)
    assert all(np.isfinite(x["loss"]) for x in rows if x["step"] in saved)


def test_nonfinite_skips_leave_the_weights_and_then_stop(setup, tmp_path):
    ck = tmp_path / "skipping"
    r = _train(["--config", setup["config"], f"checkpoint.dir={ck}", "optimizer.lr=1e30",
                "optimizer.clip=0", "nonfinite_skips=2", "steps=6"])
    assert r.returncode == 1 and "after skipping 2" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert r.stderr.count("update skipped (") == 2


@pytest.mark.parametrize("override, words", [
    ("optimizer.lr=.nan", "optimizer.lr must be a finite number, got nan"),
    (f"steps={2 ** 70}", "steps must be at most 2147483647 (the step counter is int32)"),
    ("nonfinite_skips=-1", "nonfinite_skips must be >= 0"),
])
def test_absurd_numbers_are_refused_before_the_model_loads(setup, override, words):
    """... blamed on the override that set them, not on the YAML file."""
    r = _train(["--config", setup["config"], override], timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and words in err[0], r.stderr[-2000:]
    assert err[0].startswith(f"wedlm-train: error: override {override!r}: "), err[0]
