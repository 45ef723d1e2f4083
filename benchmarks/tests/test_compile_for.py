"""benchmarks.compiled.compile_for: the report compiles for a TPU topology through libtpu (no TPU) at a toy
shape, scales the cost to the whole depth, and refuses bad targets before compiling anything."""

import json
import os
import subprocess
import sys

from tests import tpu_compiler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.compiled.compile_for", *args],
                          env=tpu_compiler.env(), capture_output=True, text=True, timeout=400,
                          cwd=ROOT)


def test_quick_report_for_one_v5p_chip(tmp_path):
    out = tmp_path / "report"
    proc = _run("--compile-for", "v5p:1x1x1", "--model", "smoke", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.load(open(out / "compile_for.json"))
    (t,) = r["targets"]
    assert t["target"] == "v5p:1x1x1" and t["chips"] == 1
    ar, st = t["rows"]
    assert (ar["method"], st["method"], st["window"]) == ("ar", "streaming", 16)
    for row in (ar, st):
        assert row["fits"] is True and row["memory"]["total"] > 0
        assert row["cost"]["flops"] > 0 and row["cost"]["bytes accessed"] > 0
        assert row["roofline_s"] > 0 and row["bytes_over_floor"] > 0
    assert st["step_over_ar"] > 0 and st["tokens_per_s"] > 0
    md = (out / "compile_for.md").read_text()
    assert "## v5p:1x1x1 (1 chips" in md and "| streaming W16 before | 8 |" in md
    # the Decoder's v5p step options, in each row and said once in the markdown
    assert ar["compiler_options"] == st["compiler_options"] == {"xla_tpu_scoped_vmem_limit_kib": 65536}
    assert "compiled with the Decoder's libtpu options (decode.engine.planning.layouts.STEP_OPTIONS): " \
           "xla_tpu_scoped_vmem_limit_kib=65536." in md
    png = out / "compile_for.png"          # bytes / floor and step time per program
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_unrolled_cost_counts_every_layer():
    """cost_analysis counts the layer scan once; the unrolled program's flops are about three
    times the 1-layer program's layer part for 3 layers."""
    code = (
        "import json, jax\n"
        "from decode.compile import aot\n"
        "from decode.config import EngineOptions, Placement\n"
        "from benchmarks.shapes import SMOKE_SHAPE, model_config\n"
        "c = model_config(dict(SMOKE_SHAPE, num_layers=3)).replace(max_position_embeddings=4096)\n"
        "cpu = jax.devices('cpu')[0]\n"
        "kw = (EngineOptions(method='ar', window=1, slots=2, capacity=256),\n"
        "      Placement(dtype='float32', attention='tiled', kv_tile=64, page_size=0))\n"
        "raw = aot.compile_generate(c, cpu, *kw)\n"
        "one = aot.compile_generate(c.replace(num_layers=1), cpu, *kw)\n"
        "two = aot.compile_generate(c.replace(num_layers=2), cpu, *kw, scan_unroll=2)\n"
        "full = aot.unrolled_cost(aot.compile_generate, c, cpu, *kw)\n"
        "print(json.dumps([raw['cost']['flops'], one['cost']['flops'], two['cost']['flops'],\n"
        "                  full['flops']]))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw, one, two, full = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(raw - one) <= 0.01 * one          # the rolled program counts one layer
    layer = two - one
    assert layer > 0.3 * one
    assert abs(full - (one + 2 * layer)) <= 0.02 * full      # flops are linear in the layers


def test_unrolled_cost_takes_the_time_of_the_estimate_compile_where_libtpu_gives_none():
    """A whole-depth program libtpu gives no time (optimal_seconds <= 0) is compiled again with
    estimate_options; only the time comes from that compile. A positive time, or a platform
    without estimate options, compiles once."""
    from decode.compile import aot
    from wedlm_jax.runtime.compiled import estimate_options
    calls = []

    def fake(optimal, platform):
        def compile_fn(config, device, **kw):
            calls.append(kw)
            opt = 0.004 if kw.get("compiler_options") else optimal
            return dict(platform=platform, cost={"flops": 5.0, "bytes accessed": 7.0,
                                                 "optimal_seconds": opt})
        return compile_fn

    class Config:
        num_layers = 4

    cost = aot.unrolled_cost(fake(-2.0, "tpu"), Config, "dev", method="ar")
    assert [c.get("compiler_options") for c in calls] == [None, estimate_options("tpu")]
    assert all(c["scan_unroll"] == 4 and c["method"] == "ar" for c in calls)
    assert cost == {"flops": 5.0, "bytes accessed": 7.0, "optimal_seconds": 0.004,
                    "optimal_seconds_as_compiled": -2.0, "optimal_from": "estimate_options"}
    for optimal, platform in ((0.001, "tpu"), (-2.0, "cpu")):
        calls.clear()
        cost = aot.unrolled_cost(fake(optimal, platform), Config, "dev")
        assert len(calls) == 1 and cost["optimal_seconds"] == optimal and "optimal_from" not in cost


def test_step_ratios_roofline_and_libtpu():
    from benchmarks.compiled.compile_for import derive
    row = lambda method, roof, opt: dict(kind="decode", method=method, slots=8, cache="dense",
                                         roofline_s=roof, cost={"optimal_seconds": opt})
    ar, st, st_none = row("ar", 2.0, 4.0), row("streaming", 3.0, 5.0), row("streaming", 3.0, -1.0)
    derive([ar, st, st_none], tpf=4.0)
    assert st["step_over_ar"] == 1.5 and st["libtpu_step_over_ar"] == 1.25
    assert st["tokens_per_s"] == 8 * 4.0 / 3.0 and ar["tokens_per_s"] == 8 / 2.0
    assert st_none["step_over_ar"] == 1.5 and "libtpu_step_over_ar" not in st_none


def test_bad_targets_are_named_before_compiling(tmp_path):
    proc = _run("--compile-for", "v5p:1x1x1,h9000", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert "--compile-for 'h9000': unknown target; accepted: TPU topologies" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    proc = _run("--compile-for", "v5p:1x1x1", "--out", str(tmp_path / "busy"))
    assert proc.returncode == 2 and "holds files this report did not write" in proc.stderr
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    proc = _run("--compile-for", "v5p:1x1x1", "--train-lora", "-1", "--out", str(tmp_path / "l"))
    assert proc.returncode == 2 and "--train-lora -1: a rank >= 1, or 0 for none" in proc.stderr


def test_train_mfu_adds_the_attention_kernel_to_libtpus_estimate():
    """The step time is libtpu's optimal_seconds plus the uncounted attention kernel's FLOPs at
    peak; the roofline bound counts those FLOPs too; libtpu's 'no estimate' (<= 0) is no time."""
    from benchmarks.compiled.compile_for import Target, train_mfu
    t = Target(name="t", devices=(None, None), peak_flops=1e12, bandwidth=1e9, hbm=1)
    cost = {"flops": 4e12, "bytes accessed": 1e9, "optimal_seconds": 4.0}
    r = train_mfu(2e12, cost, t)
    assert r["step_s"] == 4.0 and r["mfu"] == 2e12 / (4.0 * 1e12 * 2)
    assert r["mfu_bound"] == 2e12 / (4.0 * 1e12 * 2)             # roofline max(4 s of flops, 1 s of bytes)
    r = train_mfu(2e12, cost, t, kernel_flops=1e12)               # + 1 s of kernel at peak
    assert r["kernel_s"] == 1.0 and r["step_s"] == 5.0 and r["mfu"] == 2e12 / (5.0 * 1e12 * 2)
    assert r["roofline_s"] == 5.0
    r = train_mfu(2e12, {"flops": 1e12, "bytes accessed": 3e9, "optimal_seconds": 3.5}, t, 1e12)
    assert r["roofline_s"] == 3.0 and r["step_s"] == 4.5          # bytes bound the roofline
    r = train_mfu(2e12, dict(cost, optimal_seconds=-3.998), t)    # SparseCore ops in the program
    assert r["mfu"] is None and r["step_s"] is None and "no estimate" in r["mfu_note"]
    assert r["mfu_bound"] == 2e12 / (4.0 * 1e12 * 2)
    r = train_mfu(11e12, cost, t, kernel_flops=1e12)              # model FLOPs above compiled + kernel
    assert r["mfu_bound"] is None and "no bound" in r["mfu_bound_note"] and r["mfu"] > 0


def test_the_7b_decode_shape_is_the_checked_in_qwen25_7b_architecture():
    from benchmarks.shapes import QWEN25_7B, model_config
    from wedlm_jax.checkpoints import read_config
    want = read_config(os.path.join(ROOT, "configs", "arch", "qwen2.5-7b"))
    got = model_config(QWEN25_7B)
    assert got == want.replace(bos_token_id=None, eos_token_id=None)
