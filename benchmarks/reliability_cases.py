"""Issue 15's fault cases (training, export, lock, RoPE, conversion, smaller ones), each run as a
user would run it: exit code, first line of the program's message, and what happened on disk.

    python -m benchmarks.reliability_cases --root /work/main --label before --out /tmp/before.json
    python -m benchmarks.reliability_cases --root . --label after --out /tmp/after.json
    python -m benchmarks.reliability_cases --table /tmp/before.json /tmp/after.json

`--root` is the checkout whose `train` / `wedlm_jax` are imported (PYTHONPATH); every case runs in
a fresh folder under a temp dir with `configs/tiny_cpu.yaml` and `python -m tests.synthetic.train_data` data.
The decoding cases (issue item 6) belong to the decode/ rewrite and are not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PY = sys.executable
TRAIN_BASE = ["optimizer.warmup_steps=2", "checkpoint.every=3", "progress=false"]


def _env(root):
    return dict(os.environ, PYTHONPATH=os.path.abspath(root), JAX_PLATFORMS="cpu",
                TF_CPP_MIN_LOG_LEVEL="3")


def _message(text: str) -> str:
    lines = [l.rstrip() for l in text.splitlines() if l.strip()]
    for l in lines:
        if re.match(r"^(wedlm-(train|convert): |max \|logits)", l):
            return l[:200]
    for l in lines:
        if l.startswith("Traceback"):
            last = [x for x in lines if re.match(r"^[A-Za-z_.]+(Error|Exception|Interrupt)\b", x)]
            return (f"Traceback ({len(lines)} lines): " + (last[-1] if last else ""))[:200]
    for l in lines:
        if "WARNING" in l or "warning" in l:
            return l[:200]
    return lines[-1][:200] if lines else "(no output)"


def _run(root, args, cwd, timeout=600):
    t0 = time.time()
    p = subprocess.run([PY, *args], cwd=cwd, env=_env(root), capture_output=True, text=True,
                       timeout=timeout)
    out = p.stdout + p.stderr
    return {"rc": p.returncode, "message": _message(out), "lines": len(out.splitlines()),
            "seconds": round(time.time() - t0, 1)}


def _train(root, cwd, *overrides, flags=()):
    return _run(root, ["-m", "train.main", "--config", "tiny_cpu.yaml", *flags, *TRAIN_BASE,
                       *overrides], cwd)


def _ls(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else None


def _metric_steps(d):
    path = os.path.join(d, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(l)["step"] for l in open(path) if l.strip()]


# ------------------------------------------------------------------------------ the cases

def training_cases(root, work, template):
    out = {}

    def fresh(name):
        d = os.path.join(work, name)
        shutil.copytree(template, d)
        return d

    d = fresh("shape")
    r = _train(root, work, f"checkpoint.dir={d}", "steps=8", "model.config.hidden_size=128")
    r["effect"] = f"dir now {_ls(d)}"
    out["1a resume with model.config.hidden_size changed (steps=8)"] = r

    for key, ov in (("objective", "objective.kind=plain"),
                    ("batch", "data.global_batch_size=16")):
        d = fresh(key)
        r = _train(root, work, f"checkpoint.dir={d}", "steps=6", ov)
        r["effect"] = f"metrics steps {_metric_steps(d)}"
        out[f"1b final checkpoint present, {ov}"] = r

    d = fresh("same")
    r = _train(root, work, f"checkpoint.dir={d}", "steps=6")
    r["effect"] = f"metrics steps {_metric_steps(d)}"
    out["1c final checkpoint present, same config"] = r

    d = fresh("extend")
    r = _train(root, work, f"checkpoint.dir={d}", "steps=8")
    r["effect"] = f"dir {_ls(d)}"
    out["1d extend steps=8 (allowed: resumes)"] = r

    d = fresh("fresh")
    r = _train(root, work, f"checkpoint.dir={d}", "steps=6", "checkpoint.resume=false",
               "objective.kind=plain")
    r["effect"] = f"dir {_ls(d)}"
    out["1e checkpoint.resume=false with a changed objective"] = r

    d = fresh("unreadable")
    for sub in os.listdir(os.path.join(d, "6", "state")):
        if sub.startswith("ocdbt") or sub == "d":
            shutil.rmtree(os.path.join(d, "6", "state", sub))
    r = _train(root, work, f"checkpoint.dir={d}", "steps=8")
    r["effect"] = f"dir {_ls(d)}"
    out["1f resume (steps=8) from a complete but unreadable step 6 (array data deleted)"] = r

    d = fresh("repeat")
    shutil.rmtree(os.path.join(d, "6"))
    r = _train(root, work, f"checkpoint.dir={d}", "steps=6")
    steps = _metric_steps(d)
    r["effect"] = f"metrics.jsonl steps {steps}"
    out["7c metrics.jsonl after resuming from step 3 (rows 4-6 were logged)"] = r
    return out


def export_cases(root, work):
    out = {}
    src = os.path.join(work, "hf_src")
    r = _train(root, work, "checkpoint.dir=null", "steps=2", f"checkpoint.export_hf={src}")
    assert r["rc"] == 0, r
    for name in ("README.md", "generation_config.json"):
        with open(os.path.join(src, name), "w") as f:
            f.write("{}\n")
    before = _ls(src)
    r = _train(root, work, "checkpoint.dir=null", "steps=2", "model.config=null",
               f"model.from_hf={src}", "data.tokenizer=null", f"checkpoint.export_hf={src}")
    r["effect"] = f"source folder {before} -> {_ls(src)}"
    out["2a checkpoint.export_hf = model.from_hf"] = r

    foreign = os.path.join(work, "notes")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("mine\n")
    r = _train(root, work, "checkpoint.dir=null", "steps=6", f"checkpoint.export_hf={foreign}")
    r["effect"] = f"after {r['seconds']} s"
    out["2b export_hf = a non-empty non-checkpoint folder"] = r

    other = os.path.join(work, "hf_other")
    shutil.copytree(src, other)
    r = _train(root, work, "checkpoint.dir=null", "steps=2", f"checkpoint.export_hf={other}")
    r["effect"] = f"after {r['seconds']} s"
    out["2c export_hf = an existing checkpoint, no force"] = r
    return out


def lock_case(root, work):
    d = os.path.join(work, "locked")
    env = _env(root)
    first = subprocess.Popen([PY, "-m", "train.main", "--config", "tiny_cpu.yaml", *TRAIN_BASE,
                              f"checkpoint.dir={d}", "steps=40", "checkpoint.every=5"], cwd=work,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not os.path.exists(os.path.join(d, "metrics.jsonl")):
        time.sleep(0.5)
    r = _train(root, work, f"checkpoint.dir={d}", "steps=40", "checkpoint.every=5")
    first_out = first.communicate(timeout=600)[0]
    steps = _metric_steps(d)
    r["effect"] = (f"first run rc {first.returncode}; metrics.jsonl {len(steps)} rows for "
                   f"{len(set(steps))} steps")
    return {"3 a second run into the same checkpoint.dir while the first runs": r}


ROPE_SNIPPET = r"""
import json, os, sys, numpy as np
import importlib.util
_hf = 'tests_root/synthetic/hf.py'  # tests/hf_models.py in trees before the synthetic package
_hf = _hf if os.path.exists(_hf) else 'tests_root/tests/hf_models.py'
spec = importlib.util.spec_from_file_location('hf_models', _hf)
hm = importlib.util.module_from_spec(spec); spec.loader.exec_module(hm)
make_hf_model, hf_logits = hm.make_hf_model, hm.hf_logits
path = make_hf_model('qwen3', 'hf_rope', rope='default', max_position_embeddings=64)
cfg = json.load(open(path + '/config.json'))
cfg['rope_parameters'] = {'rope_type': 'default', 'rope_theta': THETA_P}
cfg['rope_scaling'] = SCALING
cfg.pop('rope_theta', None)
cfg.update(TOP)
json.dump(cfg, open(path + '/config.json', 'w'))
import jax, jax.numpy as jnp
from wedlm_jax.model import Transformer
from wedlm_jax.convert import load_hf_checkpoint
try:
    mc, params = load_hf_checkpoint(path, progress=False)
except Exception as e:
    print('wedlm-convert: error: ' + str(e).splitlines()[0]); sys.exit(2)
tok = np.arange(40).reshape(1, 40) % 96
pos = np.arange(40).reshape(1, 40)
ours = np.asarray(Transformer(mc).apply({'params': params}, tok, pos), np.float32)
ref = hf_logits(path, tok, pos)
print('max |logits - transformers| = %.3g' % float(np.abs(ours - ref).max()))
"""


def rope_cases(root, work, tests_root):
    out = {}
    os.makedirs(os.path.join(work, "rope"), exist_ok=True)
    os.symlink(os.path.abspath(tests_root), os.path.join(work, "rope", "tests_root"))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    for name, theta_p, top in (("4a rope_parameters(default, theta 1e4) + rope_scaling(yarn)",
                                10000.0, {}),
                               ("4b rope_parameters(theta 1e6) + rope_scaling(yarn), no other theta",
                                1e6, {})):
        code = (ROPE_SNIPPET.replace("THETA_P", repr(theta_p)).replace("SCALING", repr(yarn))
                .replace("TOP", repr(top)))
        shutil.rmtree(os.path.join(work, "rope", "hf_rope"), ignore_errors=True)
        r = _run(root, ["-c", code], os.path.join(work, "rope"))
        lines = r["message"]
        r["effect"] = lines
        out[name] = r
    return out


def _make_hf(root, work, name, big=False):
    """A random HF checkpoint of the tiny (or a ~150 MB) qwen3 config, written by this project."""
    code = f"""
import numpy as np, jax
from wedlm_jax.config import ModelConfig
from wedlm_jax import model
from wedlm_jax.convert import save_hf_checkpoint
mc = ModelConfig(model_type='qwen3', vocab_size={32000 if big else 96}, hidden_size={512 if big else 32},
                 intermediate_size={1536 if big else 64}, num_layers={8 if big else 2}, num_heads=4,
                 num_kv_heads=2, head_dim={128 if big else 8}, qk_norm=True)
params = jax.tree.map(np.asarray, model.init_params(mc, jax.random.key(0)))
save_hf_checkpoint(mc, params, {name!r}, progress=False, dtype='f32')
"""
    r = _run(root, ["-c", code], work)
    assert r["rc"] == 0, r
    return os.path.join(work, name)


def _poke_nan(path):
    """Put a NaN into the first element of the last tensor of model.safetensors."""
    import struct
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
        name = sorted((k for k in header if k != "__metadata__"),
                      key=lambda k: header[k]["data_offsets"][0])[-1]
        fh.seek(8 + n + header[name]["data_offsets"][0])
        fh.write(struct.pack("<f", float("nan")))
    return name


def _partials(folder):
    return [n for n in os.listdir(folder) if ".partial-" in n]


def _kill_mid_write(root, work, src, out_name, sig):
    """orbax-to-hf of the big checkpoint, signalled once the partial folder exists."""
    p = subprocess.Popen([PY, "-m", "wedlm_jax.convert", "orbax-to-hf", "--orbax", src, "--out",
                          out_name, "--no-progress", "--max-shard-size", "20MB"], cwd=work,
                         env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         # a shell's background job inherits SIGINT ignored: give Ctrl-C its default
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    mine = lambda: [n for n in _partials(work) if n.startswith(f".{out_name}.partial-")]
    while time.time() < deadline and not any(os.listdir(os.path.join(work, n)) for n in mine()):
        time.sleep(0.05)
    time.sleep(0.3)  # mid-write: the first shard files exist
    p.send_signal(sig)
    text = p.communicate(timeout=120)[0]
    return {"rc": p.returncode, "message": _message(text) or f"(killed by signal {sig})",
            "lines": len(text.splitlines()), "seconds": None}


def conversion_cases(root, work):
    out = {}
    big_hf = _make_hf(root, work, "big_hf", big=True)
    r = _run(root, ["-m", "wedlm_jax.convert", "hf-to-orbax", "--hf", big_hf, "--out", "big_orbax",
                    "--no-progress"], work)
    assert r["rc"] == 0, r
    for name, sig in (("5a SIGKILL during orbax-to-hf", signal.SIGKILL),
                      ("5b SIGTERM during orbax-to-hf", signal.SIGTERM),
                      ("5c SIGINT (Ctrl-C) during orbax-to-hf", signal.SIGINT)):
        out_name = "out_" + str(int(sig))
        r = _kill_mid_write(root, work, "big_orbax", out_name, sig)
        r["effect"] = (f"its partial folder left: "
                       f"{any(n.startswith(f'.{out_name}.') for n in _partials(work))}; "
                       f"{out_name} written: {os.path.isdir(os.path.join(work, out_name))}")
        out[name] = r
        if sig == signal.SIGKILL:
            left = len(_partials(work))
            r = _run(root, ["-m", "wedlm_jax.convert", "orbax-to-hf", "--orbax", "big_orbax",
                            "--out", "out_next", "--no-progress"], work)
            r["effect"] = f"partial folders {left} -> {len(_partials(work))}"
            out["5d the next conversion after the SIGKILL"] = r

    code = ("import errno, sys\nfrom wedlm_jax import safetensors_io as st\n"
            "def full(*a, **k):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "st.write_file = full\nfrom wedlm_jax import convert\n"
            "sys.exit(convert.main(['orbax-to-hf', '--orbax', 'big_orbax', '--out', 'out_full', "
            "'--no-progress']))")
    r = _run(root, ["-c", code], work)
    r["effect"] = f"partial folders {len(_partials(work))}"
    out["5e disk full (OSError ENOSPC injected in the safetensors writer)"] = r

    shutil.copytree(os.path.join(work, "big_orbax"), os.path.join(work, "trunc_orbax"))
    biggest = max((os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(work, "trunc_orbax",
                                                                             "params")) for f in fs),
                  key=os.path.getsize)
    with open(biggest, "r+b") as fh:
        fh.truncate(os.path.getsize(biggest) // 2)
    r = _run(root, ["-m", "wedlm_jax.convert", "orbax-to-hf", "--orbax", "trunc_orbax", "--out",
                    "out_trunc", "--no-progress"], work)
    r["effect"] = f"truncated {os.path.relpath(biggest, work)}"
    out["5f orbax-to-hf on a truncated Orbax data file"] = r

    small = _make_hf(root, work, "nan_hf")
    name = _poke_nan(small)
    r = _run(root, ["-m", "wedlm_jax.convert", "hf-to-orbax", "--hf", small, "--out", "nan_orbax",
                    "--no-progress"], work)
    r["effect"] = f"NaN put in {name}; output written: {os.path.isdir(os.path.join(work, 'nan_orbax'))}"
    out["5g hf-to-orbax with a NaN weight"] = r
    return out


def small_cases(root, work):
    out = {}
    with open(os.path.join(work, "afile"), "w") as f:
        f.write("x\n")
    out["7a checkpoint.dir is a file"] = _train(root, work, "checkpoint.dir=afile", "steps=2")
    out["7b objective.block_size=128 > data.seq_len=64"] = _train(
        root, work, "checkpoint.dir=null", "steps=2", "objective.block_size=128")
    out["7d override steps=abc"] = _train(root, work, "checkpoint.dir=null", "steps=abc")
    return out


def run_all(root, label, only):
    work = tempfile.mkdtemp(prefix=f"rel-cases-{label}-")
    root = os.path.abspath(root)
    shutil.copy(os.path.join(root, "configs", "tiny_cpu.yaml"), work)
    subprocess.run([PY, "-m", "tests.synthetic.train_data", "data/tiny"], cwd=work, env=_env(root), check=True,
                   capture_output=True)
    results = {}
    if "small" in only:
        results.update(small_cases(root, work))
    if "train" in only:
        template = os.path.join(work, "template")
        r = _train(root, work, f"checkpoint.dir={template}", "steps=6")
        assert r["rc"] == 0, r
        results.update(training_cases(root, work, template))
    if "export" in only:
        results.update(export_cases(root, work))
    if "lock" in only:
        results.update(lock_case(root, work))
    if "rope" in only:
        results.update(rope_cases(root, work, os.path.dirname(os.path.abspath(__file__)) + "/.."))
    if "convert" in only:
        results.update(conversion_cases(root, work))
    shutil.rmtree(work, ignore_errors=True)
    return results


def table(before: dict, after: dict) -> str:
    rows = ["| case | before: rc | before: message / effect | after: rc | after: message / effect |",
            "|---|---|---|---|---|"]
    esc = lambda s: str(s).replace("|", "\\|")
    for case in sorted(set(before) | set(after)):
        b, a = before.get(case, {}), after.get(case, {})
        cell = lambda r: esc(r.get("message", "")) + (f" — {esc(r['effect'])}" if r.get("effect")
                                                      and r.get("effect") != r.get("message") else "")
        rows.append(f"| {case} | {b.get('rc', '')} | {cell(b)} | {a.get('rc', '')} | {cell(a)} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".")
    p.add_argument("--label", default="run")
    p.add_argument("--out")
    p.add_argument("--only", default="small,train,export,lock,rope,convert")
    p.add_argument("--table", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if args.table:
        print(table(*(json.load(open(f)) for f in args.table)))
        return 0
    results = run_all(args.root, args.label, args.only.split(","))
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
