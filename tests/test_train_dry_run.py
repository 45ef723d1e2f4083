"""`wedlm-train --dry-run`: the printed per-device memory equals XLA's memory analysis of the same
step compiled independently; a step that does not fit --device-memory exits 1 with the numbers;
bad input (remat policy, mesh vs devices or batch, topology) exits 2 before anything compiles. No
weights and no data are read (the data files named in the config do not exist)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import yaml

from tests.synthetic import train_data as fixtures
from train import main as main_lib
from tests import xla

from tests.compiles import COMPILES  # noqa: E402 - every compile (or cache load) here
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tmp_path, **top) -> str:
    d = {"model": {"config": dict(fixtures.TINY_MODEL)},
         "data": {"train_files": [str(tmp_path / "absent.jsonl")], "seq_len": 32,
                  "global_batch_size": 16},
         "objective": {"kind": "dual_stream", "block_size": 8},
         "optimizer": {"lr": 1e-3, "final_lr": 1e-4, "grad_accum": 2},
         "mesh": {"data": -1, "fsdp": 4, "tensor": 1},
         "steps": 10, "compute_dtype": "f32", "remat": "full"}
    d.update(top)
    path = str(tmp_path / "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(d, f)
    return path


SCRIPT = textwrap.dedent("""
    import contextlib, io, json, re, sys
    import jax, jax.numpy as jnp
    from train import main as main_lib, step as step_lib
    from train.config import load_config, model_config
    from wedlm_jax.sharding import make_mesh
    cfg_path, out = sys.argv[1], sys.argv[2]
    assert jax.device_count() == 8
    res = {}

    def dry(*extra):
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = main_lib.main(["--config", cfg_path, "--dry-run", *extra])
        return rc, buf.getvalue(), err.getvalue()

    res["fit"] = dry("--device-memory", "1", "--devices", "8")
    # the same step compiled here, independently of train/dry_run.py
    cfg = load_config(cfg_path)
    mc = model_config(cfg).replace(mask_token_id=95)
    mesh = make_mesh(2, 4, 1)
    opt = step_lib.make_optimizer(cfg)
    sh = step_lib.state_shardings(mc, opt, mesh)
    bsh = step_lib.batch_shardings(mesh)
    batch = {k: jax.ShapeDtypeStruct((16,) if k == "index" else (16, 32),
                                     jnp.bool_ if k == "maskable" else jnp.int32, sharding=bsh[k])
             for k in step_lib.BATCH_KEYS}
    fn = step_lib.make_train_step(cfg, mc, opt, mesh, sh, 95)
    with jax.set_mesh(mesh):
        m = fn.jitted.lower(step_lib.state_shapes(mc, opt, sh), batch).compile().memory_analysis()
    res["xla"] = {k: getattr(m, k + "_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
    total = res["xla"]["argument"] + res["xla"]["output"] - res["xla"]["alias"] + res["xla"]["temp"]
    res["no_fit"] = dry("--device-memory", repr(total / 2 ** 30 * 0.9), "--devices", "8")
    res["bad_batch"] = dry("--device-memory", "80", "--devices", "8", "data.global_batch_size=12")
    with open(out, "w") as f:
        json.dump(res, f)
""")


def _bytes(text, label):
    return int(re.search(label + r"\s+[\d.]+ GiB\s+\((\d+) B\)", text).group(1))


def test_dry_run_reports_xla_memory_and_refuses_when_too_big(tmp_path):
    cfg = _config(tmp_path)
    out = str(tmp_path / "res.json")
    # the three compiles of the same step share a compilation cache (one real compile)
    env = dict(os.environ, XLA_FLAGS=xla.flags(8),
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jc"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, cfg, out], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.load(open(out))
    rc, text, err = res["fit"]
    assert rc == 0, err
    mem = res["xla"]
    assert mem["argument"] > 0 and mem["temp"] > 0
    for label, key in (("arguments", "argument"), ("outputs", "output"), ("aliased", "alias"),
                       ("temporaries", "temp")):
        assert _bytes(text, label) == mem[key], (label, text)
    total = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    assert _bytes(text, "total") == total
    assert "data=2 fsdp=4 tensor=1 on 8 cpu devices" in text and "remat full" in text
    assert "1 row(s) per device per microbatch" in text  # 16 rows / 2 microbatches / (data 2 x fsdp 4)
    assert re.search(r"step FLOPs\s+[\d.e+]+ per device", text)
    assert re.search(r"compile\s+[\d.]+ s lowering \+ [\d.]+ s compiling", text)
    assert "FITS" in text
    rc, text, err = res["no_fit"]
    assert rc == 1 and "DOES NOT FIT" in text and _bytes(text, "total") == total, text + err
    rc, text, err = res["bad_batch"]
    assert rc == 2 and "not divisible by the batch-sharding mesh axes data x fsdp = 8" in err, err


def _refused(argv, capsys, pattern):
    before = len(COMPILES)
    rc = main_lib.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(pattern, err), err
    assert len(COMPILES) == before, "something was compiled before the error"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_dry_run_flags_refused_without_dry_run(tmp_path, capsys):
    cfg = _config(tmp_path)
    for extra, flag in ((["--device-memory", "80"], "--device-memory"), (["--devices", "4"], "--devices"),
                        (["--topology", "v5e:2x2"], "--topology"),
                        (["--json", str(tmp_path / "f.json")], "--json")):
        code = main_lib.main(["--config", cfg, *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"wedlm-train: error: {flag} goes with --dry-run"), err


def test_bad_input_named_before_compiling(tmp_path, capsys):
    cfg = _config(tmp_path)
    base = ["--config", cfg, "--dry-run", "--device-memory", "80"]
    _refused(base + ["remat=dots"], capsys, r"remat must be one of full, save_dots, none")
    _refused(base + ["--devices", "1"], capsys, r"mesh.fsdp x mesh.tensor = 4 does not divide the 1 devices")
    _refused(["--config", cfg, "--dry-run"], capsys, r"--dry-run needs --device-memory")
    _refused(base + ["--topology", "v5e"], capsys, r"--topology 'v5e': unknown target; accepted: "
                                                   r"TPU topologies GEN:AxB\[xC\] .* or GPUs h100\[:N\]")
    _refused(base + ["--topology", "h100:0"], capsys, r"'h100:0': unknown target")
    if importlib.util.find_spec("libtpu") is None:
        _refused(base + ["--topology", "tpu:v5e:2x2"], capsys,
                 r"the TPU compiler is not installed: pip install 'jax\[tpu\]'")
    if not _installed("jax_plugins.xla_cuda12"):
        _refused(base + ["--topology", "h100"], capsys,
                 r"'h100': XLA's GPU compiler is not installed: pip install 'jax\[cuda12\]'")
    # The model architecture must be readable without weights: a missing config.json is named.
    hf = _config(tmp_path, model={"from_hf": str(tmp_path / "nowhere")})
    _refused(["--config", hf, "--dry-run", "--device-memory", "80", "--devices", "1"], capsys,
             r"nowhere/config.json does not exist; the dry run reads only the architecture")
