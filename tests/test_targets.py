"""Accelerators named for compiles without the hardware (wedlm_jax.runtime.targets): TPU
topologies and GPUs by name; an unknown name lists the accepted forms, a target whose compiler is
not installed names the install command, at every door that takes one, in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import tpu_compiler
from wedlm_jax.runtime import targets
from wedlm_jax.config import ModelConfig


@pytest.mark.parametrize("name", ["v7x:2x2", "v5p", "h200", "h100:0", "h100:x", "cuda:", "tpu:v9:1x1"])
def test_unknown_targets_list_the_accepted_forms(name):
    with pytest.raises(targets.TargetError, match=r"unknown target; accepted: TPU topologies "
                                                  r"GEN:AxB\[xC\] with GEN one of v4, v5e, v5p, v6e"
                                                  r".* or GPUs h100\[:N\]"):
        targets.describe_target(name)


def test_a_gpu_target_without_its_compiler_names_the_install_command(monkeypatch):
    monkeypatch.setattr(targets, "_installed", lambda module: False)
    with pytest.raises(targets.TargetError, match=r"'h100:8': XLA's GPU compiler is not installed: "
                                                  r"pip install 'jax\[cuda12\]' .*make gpu-compiler"):
        targets.describe_target("cuda:h100:8")


def test_a_tpu_topology_is_described_with_its_chip():
    code = ("import json; from wedlm_jax.runtime.targets import describe_target as d\n"
            "from wedlm_jax.runtime.targets import tpu_generation as g\n"
            "devs, chip = d('tpu:v5p:2x2x2'); one, c1 = d('v5e:1x1')\n"
            "print(json.dumps([len(devs), devs[0].platform, chip.hbm, len(one), c1.bandwidth,\n"
            "                  g(devs[0]), g(one[0]), g(d('v6e:2x4')[0][0])]))")
    proc = subprocess.run([sys.executable, "-c", code], env=tpu_compiler.env(), capture_output=True,
                          text=True, timeout=300, cwd=tpu_compiler.ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n, platform, hbm, one, bw, *gens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (n, platform, hbm, one, bw) == (8, "tpu", 95 << 30, 1, 0.819e12)
    assert gens == ["v5p", "v5e", "v6e"]      # libtpu's device kinds: "TPU v5", "TPU v5 lite", ...


def test_the_decode_door_refuses_a_gpu_target_it_cannot_compile_for_in_one_line(tmp_path):
    folder = tmp_path / "arch"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(ModelConfig(
        model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, mask_token_id=63).to_hf_dict()))
    env = dict(tpu_compiler.env(), PYTHONPATH=tpu_compiler.ROOT)      # no GPU compiler on the path
    proc = subprocess.run([sys.executable, "-m", "decode.cli", "--checkpoint", str(folder),
                           "--dry-run", "--topology", "h100:4"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tpu_compiler.ROOT)
    if targets._installed("jax_plugins.xla_cuda12"):
        assert proc.returncode in (0, 1), proc.stderr[-2000:]
    else:
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            "wedlm-decode: error: 'h100:4': XLA's GPU compiler is not installed: pip install "
            "'jax[cuda12]' (or, compile-only, `make gpu-compiler`: jax-cuda12-plugin and "
            "jax-cuda12-pjrt into .venv/gpu-compiler, on PYTHONPATH)"]
