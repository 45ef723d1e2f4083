"""wedlm-convert under faults: partial folders of dead writers are removed by the next
writer (a live one's are kept); SIGTERM / SIGINT clean up and end with one line; a full disk is one
line naming the file system and the size needed; a truncated Orbax checkpoint is one line naming
it; NaN/Inf weights are refused naming the tensor unless --allow-nonfinite."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import types
import json

import jax
import numpy as np
import pytest

from wedlm_jax import convert, model as model_lib
from wedlm_jax.checkpoints import tensors
from wedlm_jax.checkpoints.folders import host_tag
from wedlm_jax import safetensors_io as st
from wedlm_jax.config import ModelConfig
from wedlm_jax.runtime.failures import format_bytes

CONFIG = ModelConfig(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    params = jax.tree.map(np.asarray, model_lib.init_params(CONFIG, jax.random.key(0)))
    hf = convert.save_hf_checkpoint(CONFIG, params, str(root / "hf"), progress=False)
    orbax = convert.save_orbax(CONFIG, params, str(root / "orbax"))
    return {"hf": hf, "orbax": orbax, "params": params}


def _hidden(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_dead_writers_partials_removed_live_ones_kept(folders, tmp_path):
    host = host_tag()
    # a writer killed outright (os._exit mid-write: no cleanup runs) leaves its partial folder
    script = textwrap.dedent(f"""
        import os
        from wedlm_jax import convert
        from wedlm_jax.checkpoints import hf
        config, params = convert.load_hf_checkpoint({folders['hf']!r}, progress=False)
        real, n = hf.to_host, []
        def dying(x):
            n.append(1)
            if len(n) == 6:
                os._exit(9)
            return real(x)
        hf.to_host = dying
        convert.save_hf_checkpoint(config, params, {str(tmp_path / 'a')!r}, progress=False)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    (killed,) = _hidden(tmp_path)
    assert killed.startswith(f".a.partial-{host}-") and not os.path.exists(tmp_path / "a")
    # a live writer's partial folder (another process, still running) must survive
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live_name = f".b.partial-{host}-{live.pid}-xyz"
        os.makedirs(tmp_path / live_name / "params")
        # an output replaced by a writer killed between its two renames: the old one goes back
        old_name = f".c.old-{host}-{_dead_pid()}-q"
        os.makedirs(tmp_path / old_name / "c")
        (tmp_path / old_name / "c" / "config.json").write_text("{}")
        other_host = f".d.partial-elsewhere-{_dead_pid()}-z"  # another machine's: not ours to judge
        os.makedirs(tmp_path / other_host)

        assert convert.main(["orbax-to-hf", "--orbax", folders["orbax"], "--out",
                             str(tmp_path / "next"), "--no-progress"]) == 0
        assert _hidden(tmp_path) == sorted([live_name, other_host])
        assert sorted(os.listdir(tmp_path)) == sorted(["c", "next", live_name, other_host])
        assert os.listdir(tmp_path / "c") == ["config.json"]
    finally:
        live.kill()
        live.wait()


SLOW_WRITE = """
import sys, time
from wedlm_jax import convert
from wedlm_jax.checkpoints import {module} as seams
real = seams.{seam}
def slow(*args, **kw):
    out = real(*args, **kw)
    print("writing", flush=True)
    time.sleep(60)
    return out
seams.{seam} = slow
sys.exit(convert.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig,module,seam,command", [
    (signal.SIGTERM, "hf", "write_safetensors", "orbax-to-hf"),
    (signal.SIGINT, "orbax", "copy_tokenizer", "hf-to-orbax"),  # after Orbax's writer threads ran
])
def test_signal_cleans_up_with_one_line(folders, tmp_path, sig, module, seam, command):
    out = str(tmp_path / "out")
    src = ["--orbax", folders["orbax"]] if command == "orbax-to-hf" else ["--hf", folders["hf"]]
    p = subprocess.Popen([sys.executable, "-c", SLOW_WRITE.format(module=module, seam=seam), command, *src,
                          "--out", out, "--no-progress"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.stdout.readline().strip() == "writing"
    (partial,) = _hidden(tmp_path)
    assert ".partial-" in partial and os.listdir(tmp_path / partial)  # mid-write
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == (143 if sig == signal.SIGTERM else 130), err
    lines = [l for l in err.splitlines() if l.startswith("wedlm-convert")]
    assert lines == [f"wedlm-convert: interrupted by {signal.Signals(sig).name}; {out} was not "
                     f"changed (partial output removed)"], err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_disk_full_is_one_line(folders, tmp_path, monkeypatch, capsys):
    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "write_file", full)
    out = str(tmp_path / "out")
    assert convert.main(["orbax-to-hf", "--orbax", folders["orbax"], "--out", out,
                         "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    need = convert.params_nbytes(folders["params"])
    assert err == [f"wedlm-convert: error: no space left on {convert.mount_point(out)}, needed "
                   f"about {format_bytes(need)}; {out} was not changed (partial output removed)"]
    assert os.listdir(tmp_path) == []
    # and when the free space is known to be short, nothing is written at all
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: types.SimpleNamespace(total=10, used=10, free=0))
    assert convert.main(["orbax-to-hf", "--orbax", folders["orbax"], "--out", out,
                         "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"wedlm-convert: error: the converted checkpoint needs about {format_bytes(need)} under "
        f"{out}, only 0 bytes free on {convert.mount_point(out)}")
    assert os.listdir(tmp_path) == []


def test_truncated_orbax_is_one_line(folders, tmp_path, capsys):
    src = shutil.copytree(folders["orbax"], str(tmp_path / "orbax"))
    data = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(src, "params"))
            for f in fs if os.sep + "d" + os.sep in os.path.join(dp, f)]
    biggest = max(data, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    assert convert.main(["orbax-to-hf", "--orbax", src, "--out", str(tmp_path / "hf"),
                         "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"wedlm-convert: error: {os.path.join(src, 'params')}: cannot read array "), err
    assert "of the Orbax checkpoint (truncated or damaged): OUT_OF_RANGE" in err[0]


def _poke(file, name, value):
    with open(file, "r+b") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
        fh.seek(8 + n + header[name]["data_offsets"][0] + 4 * 3)
        fh.write(struct.pack("<f", value))


def test_nonfinite_weights_refused_unless_allowed(folders, tmp_path, capsys):
    hf = shutil.copytree(folders["hf"], str(tmp_path / "hf"))
    name = "model.layers.1.mlp.down_proj.weight"
    _poke(os.path.join(hf, "model.safetensors"), name, float("inf"))
    out = str(tmp_path / "orbax")
    assert convert.main(["hf-to-orbax", "--hf", hf, "--out", out, "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"wedlm-convert: error: {os.path.join(hf, 'model.safetensors')}: tensor {name!r} has 1 "
        f"non-finite value(s) (NaN/Inf); refusing to convert it (pass --allow-nonfinite / "
        f"allow_nonfinite=True to keep them)")
    assert not os.path.exists(out)
    assert convert.main(["hf-to-orbax", "--hf", hf, "--out", out, "--no-progress",
                         "--allow-nonfinite"]) == 0
    capsys.readouterr()
    # the Orbax side checks too: a NaN saved into an Orbax folder is refused on the way back
    params = jax.tree.map(np.copy, folders["params"])
    path, leaf = next((k, v) for k, v in jax.tree_util.tree_leaves_with_path(params)
                      if "o_proj" in jax.tree_util.keystr(k))
    leaf.reshape(-1)[5] = np.nan
    bad = convert.save_orbax(CONFIG, params, str(tmp_path / "bad_orbax"))
    assert convert.main(["orbax-to-hf", "--orbax", bad, "--out", str(tmp_path / "back"),
                         "--no-progress"]) == 2
    err = capsys.readouterr().err
    name = f"{path[0].key}{jax.tree_util.keystr(path[1:])}"
    assert err == (f"wedlm-convert: error: {os.path.join(bad, 'params')}: tensor {name!r} has 1 "
                   f"non-finite value(s) (NaN/Inf); refusing to convert it (pass --allow-nonfinite "
                   f"/ allow_nonfinite=True to keep them)\n"), err
    assert not os.path.exists(tmp_path / "back")
    assert convert.main(["orbax-to-hf", "--orbax", bad, "--out", str(tmp_path / "back"),
                         "--no-progress", "--allow-nonfinite"]) == 0


def test_count_nonfinite():
    import ml_dtypes
    x = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)
    assert tensors.count_nonfinite(x) == 3
    assert tensors.count_nonfinite(x.astype(ml_dtypes.bfloat16)) == 3
    assert tensors.count_nonfinite(np.ones((3, 4), np.float32)) == 0
