"""The Slurm launch (train/launch/slurm_task.sh, what train/launch/slurm.sbatch runs under srun):
two local processes with the variables srun sets (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS,
SLURM_PROCID, SLURM_LOCALID) and no jax.distributed flags find each other through jax's Slurm
detection (`distributed=true`) and train a mesh data=2 over both to the per-step losses of one
process on one device. The submit script runs the dry run first and calls sbatch only when the
step fits."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from tests import xla
from tests.processes import wait_all
from tests.synthetic import train_data as fixtures
from train import main as main_lib
from train.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "train", "launch")
KEYS = ("loss", "mlm_loss", "ar_loss", "grad_norm", "masked_count", "tokens")
SLURM_PORT_BASE = 65535 - 2 ** 12 + 1      # jax's Slurm port: this + SLURM_JOB_ID % 4096


def _free_slurm_port() -> int:
    for port in range(SLURM_PORT_BASE + 1000, 65535):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in jax's Slurm range")


def _wedlm_train(tmp_path) -> str:
    """A wedlm-train on PATH for the scripts: this checkout's, under this interpreter."""
    path = tmp_path / "wedlm-train"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m train.main \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def test_two_slurm_tasks_match_one_process(tmp_path):
    paths = fixtures.make_tiny_setup(str(tmp_path), num_docs=24)
    cfg = fixtures.tiny_config_dict(paths, **{"steps": 2, "mesh.data": 2, "checkpoint.every": 2})
    config = fixtures.write_config(str(tmp_path / "cfg.yaml"), cfg)
    ck = str(tmp_path / "multi")
    port = _free_slurm_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla.flags(1), PYTHONPATH=ROOT, CONFIG=config,
               WEDLM_TRAIN=_wedlm_train(tmp_path), SLURM_JOB_ID=str(port - SLURM_PORT_BASE),
               SLURM_STEP_NODELIST="127.0.0.1", SLURM_JOB_NODELIST="127.0.0.1", SLURM_NTASKS="2",
               SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1",
               JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    procs = []
    for rank in range(2):
        log = open(tmp_path / f"task{rank}.log", "w")
        procs.append(subprocess.Popen(
            ["bash", os.path.join(LAUNCH, "slurm_task.sh"), f"checkpoint.dir={ck}"], cwd=ROOT,
            env=dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)), stdout=log,
            stderr=subprocess.STDOUT))
    wait_all(procs, 300)
    logs = [open(tmp_path / f"task{i}.log").read() for i in range(2)]
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    multi = [json.loads(line) for line in open(os.path.join(ck, "metrics.jsonl"))]
    assert [r["step"] for r in multi] == [1, 2]
    one = main_lib.run(load_config(config, ["mesh.data=1", f"checkpoint.dir={tmp_path / 'one'}"]),
                       progress=False)
    ref = np.array([[r[k] for k in KEYS] for r in one["records"]])
    got = np.array([[r[k] for k in KEYS] for r in multi])
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert ref[0, 0] != ref[1, 0]


def test_submit_runs_the_dry_run_and_submits_only_what_fits(tmp_path):
    paths = fixtures.make_tiny_setup(str(tmp_path), num_docs=8)
    config = fixtures.write_config(str(tmp_path / "cfg.yaml"), fixtures.tiny_config_dict(
        paths, **{"mesh.data": 2}))
    calls = tmp_path / "sbatch.calls"
    sbatch = tmp_path / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho \"CONFIG=$CONFIG $*\" >> {calls}\n")
    sbatch.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=ROOT, CONFIG=config, WEDLM_TRAIN=_wedlm_train(tmp_path),
               SBATCH=str(sbatch), DRY_RUN="--devices 2", JAX_PLATFORMS="cpu")
    script = os.path.join(LAUNCH, "submit_slurm.sh")
    no = subprocess.run(["bash", script, "steps=3"], cwd=ROOT, env=dict(env, DEVICE_MEMORY="0.000001"),
                        capture_output=True, text=True, timeout=300)
    assert no.returncode == 1 and "nothing submitted" in no.stderr and not calls.exists(), no.stderr[-2000:]
    yes = subprocess.run(["bash", script, "steps=3"], cwd=ROOT, env=dict(env, DEVICE_MEMORY="80"),
                         capture_output=True, text=True, timeout=300)
    assert yes.returncode == 0, yes.stderr[-2000:]
    assert calls.read_text() == f"CONFIG={config} --export=ALL {LAUNCH}/slurm.sbatch steps=3\n"


def _launch_copy(tmp_path, venv: bool) -> str:
    """The launch scripts in a repository-shaped folder; with `venv`, a .venv/bin/wedlm-train
    there that records its arguments and says the step fits."""
    import shutil
    repo = tmp_path / ("with-venv" if venv else "bare")
    shutil.copytree(LAUNCH, repo / "train" / "launch")
    if venv:
        stub = repo / ".venv" / "bin" / "wedlm-train"
        stub.parent.mkdir(parents=True)
        stub.write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/calls\n')
        stub.chmod(0o755)
    return str(repo)


def test_launch_scripts_find_wedlm_train_or_say_how(tmp_path):
    """Without wedlm-train on PATH: submit_slurm.sh takes the repository's .venv/bin/wedlm-train
    (the dry run, then sbatch); with no venv either, one line says how, not `command not found`;
    slurm_task.sh outside a Slurm job says so in one line and exits 2."""
    env = dict(PATH="/usr/bin:/bin", CONFIG="configs/tiny_cpu.yaml", SBATCH="echo sbatch")
    repo = _launch_copy(tmp_path, venv=True)
    proc = subprocess.run(["bash", "train/launch/submit_slurm.sh", "mesh.fsdp=8"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls").read_text().startswith("--config configs/tiny_cpu.yaml --dry-run "
                                                       "--device-memory 80 --topology h100:8")
    assert proc.stdout.startswith("sbatch --export=ALL") and "mesh.fsdp=8" in proc.stdout
    bare = _launch_copy(tmp_path, venv=False)
    for script in ("submit_slurm.sh", "xpk.sh"):
        proc = subprocess.run(["bash", f"train/launch/{script}"], cwd=bare, capture_output=True,
                              text=True, timeout=60, env=dict(env, CLUSTER="c", IMAGE="i",
                                                              CKPT="gs://b/c"))
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 127 and len(err) == 1, (script, proc.stderr)
        assert "wedlm-train not found: run make setup" in err[0] and "WEDLM_TRAIN" in err[0]
    proc = subprocess.run(["bash", os.path.join(LAUNCH, "slurm_task.sh")], cwd=ROOT,
                          env=dict(env, WEDLM_TRAIN="false"), capture_output=True, text=True,
                          timeout=60)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "not inside a Slurm job" in err[0], err
