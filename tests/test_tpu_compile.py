"""The programs compile for a TPU: libtpu (a test dependency) compiles them here
for described topologies, no TPU needed, so a lowering that only fails on TPU fails the suite.

- the decode step (`generate` of one step; AR, streaming with both refill orders, verified) at a
  tiny shape in bf16 for one v5p chip, with the donated cache aliased (updated in place);
- the train step through `wedlm-train --dry-run --topology tpu:v5p:2x2x2` (8 chips, fsdp 8): the
  attention resolved for the TPU is splash and the compiled program holds the Pallas kernel
  (`tpu_custom_call`); the same with the loss formed a chunk of slots at a time.

Each compile runs in its own process with libtpu on its path (`tests/tpu_compiler.py`: one libtpu
per process; ALLOW_MULTIPLE_LIBTPU_LOAD lets the two pytest workers each have one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from tests import tpu_compiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU_MODEL = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 256,
             "intermediate_size": 512, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
             "head_dim": 128, "qk_norm": True, "max_position_embeddings": 4096}


def _run(args, timeout=420):
    proc = subprocess.run(args, env=tpu_compiler.env(), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


def test_libtpu_is_installed():
    """The TPU compiler is a test dependency; without it the compiles below cannot run."""
    assert tpu_compiler.installed(), (
        f"libtpu is missing from {tpu_compiler.folder()}: run `make setup` (it installs the "
        "libtpu the installed jax asks for there), or point $WEDLM_TPU_COMPILER at a folder "
        "holding it")


DECODE = textwrap.dedent("""
    import json, sys
    from jax.experimental import topologies
    from decode.compile.aot import compile_generate
    from decode.config import EngineOptions, Placement
    from wedlm_jax.config import ModelConfig
    dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:1x1x1",
                                       chips_per_host_bounds=(1, 1, 1)).devices[0]
    config = ModelConfig(**json.loads(sys.argv[1]))
    out = []
    for method, refill in (("ar", "before"), ("streaming", "before"), ("streaming", "after"),
                           ("verified", "after")):
        out.append([compile_generate(config, dev, EngineOptions(method=method, window=8,
                                                                refill=refill, slots=2,
                                                                capacity=cap),
                                     Placement(dtype="bfloat16", attention="tiled", kv_tile=128,
                                               page_size=0), live_rows=256)
                    for cap in (512, 4096)])
    print(json.dumps(out))
""")


PAGED = textwrap.dedent("""
    import json, sys
    from jax.experimental import topologies
    from decode.compile.aot import compile_generate
    from decode.config import EngineOptions, Placement
    from wedlm_jax.config import ModelConfig
    dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:1x1x1",
                                       chips_per_host_bounds=(1, 1, 1)).devices[0]
    config = ModelConfig(**json.loads(sys.argv[1]))
    out = []
    for method, refill in (("ar", "before"), ("streaming", "before")):
        out.append([compile_generate(config, dev, EngineOptions(method=method, window=8,
                                                                refill=refill, slots=2,
                                                                capacity=cap),
                                     Placement(dtype="bfloat16", attention="tiled", page_size=64),
                                     live_rows=256)
                    for cap in (512, 4096)])
    print(json.dumps(out))
""")


LAYOUTS = textwrap.dedent("""
    import json, sys
    from jax.experimental import topologies
    from decode.compile.aot import compile_generate
    from decode.config import EngineOptions, Placement
    from wedlm_jax.config import ModelConfig
    dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:1x1x1",
                                       chips_per_host_bounds=(1, 1, 1)).devices[0]
    config = ModelConfig(**json.loads(sys.argv[1]))
    engine = EngineOptions(method="ar", slots=8, capacity=1024)
    print(json.dumps({layout: compile_generate(config, dev, engine, Placement(
                          dtype="bfloat16", attention="tiled", page_size=0, weight_layout=layout),
                          scan_unroll=config.num_layers, live_rows=512)
                      for layout in ("auto", "default")}))
""")


def test_on_tpu_the_decoder_puts_its_weights_in_the_compilers_layouts():
    """On TPU the Decoder's default (weight_layout auto) compiles `generate` with the weights'
    layouts left to libtpu and keeps that program: the whole-depth step moves no more bytes than
    with row-major weights (which it copies into tile order inside each step)."""
    rc, out, err = _run([sys.executable, "-c", LAYOUTS, json.dumps(TPU_MODEL)])
    assert rc == 0, err[-4000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["auto"]["weight_layout"] == "compiler" and r["default"]["weight_layout"] == "default"
    assert r["auto"]["cost"]["bytes accessed"] <= r["default"]["cost"]["bytes accessed"], r


def test_paged_decode_steps_compile_for_tpu_with_the_ragged_kernel_and_the_pool_in_place():
    """The paged cache's decode step compiled for one v5p chip: the attention is jax's
    ragged paged attention (a Mosaic custom call in the program), the donated pool is aliased and
    no temporary grows with the pool."""
    rc, out, err = _run([sys.executable, "-c", PAGED, json.dumps(TPU_MODEL)])
    assert rc == 0, err[-4000:]
    pairs = json.loads(out.strip().splitlines()[-1])
    for small, big in pairs:
        for f in (small, big):
            assert f["platform"] == "tpu" and f["page_size"] == 64
            assert f["memory"]["alias"] >= f["cache_bytes"] > 0
            assert f["kernels"].get("tpu_custom_call", 0) >= 1, f["kernels"]   # the Mosaic kernel
        growth = big["cache_bytes"] - small["cache_bytes"]
        assert growth > 4 << 20
        assert big["memory"]["temp"] - small["memory"]["temp"] < 0.05 * growth, (small, big)


COPY_PAGES = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from wedlm_jax.runtime.targets import describe_target
    from wedlm_jax.sharding import make_mesh
    from wedlm_jax.attention import paged as pa
    mesh = make_mesh(data=4, fsdp=1, tensor=2, devices=list(describe_target("v5p:2x2x2")[0]))
    layers, per = 4, 64
    pool = jax.ShapeDtypeStruct((4 * layers * per, 64, 16, 128), jnp.bfloat16,
                                sharding=NamedSharding(mesh, P("data", None, "tensor", None)))
    ids = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        c = jax.jit(lambda p, s, d: pa.copy_pages(p, s, d, layers, 32, 8),
                    donate_argnums=0).lower(pool, ids, ids).compile()
    m = c.memory_analysis()
    print(json.dumps(dict(temp=m.temp_size_in_bytes, alias=m.alias_size_in_bytes,
                          pool=4 * layers * per * 64 * 16 * 128 * 2 // 8)))
""")


def test_a_prefix_copied_between_slot_shards_compiles_for_tpu_in_place():
    """`attention.paged.copy_pages` over slot shards (v5p:2x2x2, data 4 x tensor 2): the donated
    pool is updated in place; the temporaries hold the copied pages only, not a pool."""
    rc, out, err = _run([sys.executable, "-c", COPY_PAGES])
    assert rc == 0, err[-4000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["alias"] >= r["pool"] and r["temp"] < r["pool"] / 4, r


def test_decode_steps_compile_for_tpu_with_the_cache_in_place():
    rc, out, err = _run([sys.executable, "-c", DECODE, json.dumps(TPU_MODEL)])
    assert rc == 0, err[-4000:]
    pairs = json.loads(out.strip().splitlines()[-1])
    assert [(small["method"], small["refill"]) for small, _ in pairs] == [
        ("ar", "before"), ("streaming", "before"), ("streaming", "after"), ("verified", "after")]
    for small, big in pairs:
        for f in (small, big):
            assert f["platform"] == "tpu"
            assert f["memory"]["alias"] >= f["cache_bytes"] > 0     # the donated cache, in place
            assert f["cost"]["bytes accessed"] > 0 and f["cost"]["optimal_seconds"] > 0
        # no cache-sized temporary: the temporaries do not grow with the capacity
        growth = big["cache_bytes"] - small["cache_bytes"]
        assert growth > 4 << 20
        assert big["memory"]["temp"] - small["memory"]["temp"] < 0.05 * growth, (small, big)


def _train_config(tmp_path, **top) -> str:
    d = {"model": {"config": dict(TPU_MODEL)},
         "data": {"train_files": [str(tmp_path / "absent.jsonl")], "seq_len": 128,
                  "global_batch_size": 8},
         "objective": {"kind": "dual_stream", "block_size": 32},
         "mesh": {"data": -1, "fsdp": 8, "tensor": 1},
         "optimizer": {"lr": 1e-3, "final_lr": 1e-4},
         "steps": 10, "compute_dtype": "bf16", "remat": "full"}
    d.update(top)
    path = str(tmp_path / "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(d, f)
    return path


@pytest.mark.parametrize("loss_chunk", [0, 64])
def test_train_step_compiles_for_tpu_with_splash(tmp_path, loss_chunk):
    cfg = _train_config(tmp_path, loss_chunk=loss_chunk)
    report = str(tmp_path / "dry.json")
    rc, out, err = _run([sys.executable, "-m", "train.main", "--config", cfg, "--dry-run",
                         "--topology", "tpu:v5p:2x2x2", "--device-memory", "95", "--json", report])
    assert rc == 0, out[-2000:] + err[-4000:]
    r = json.load(open(report))
    assert r["attention"] == "splash" and r["fits"] is True
    assert r["devices"].startswith("8 tpu devices")
    assert r["kernels"].get("tpu_custom_call", 0) >= 1, r["kernels"]   # the Pallas kernel is there
    assert "tpu_custom_call x" in out and "  kernels      " in out


COSTED_TRAIN = textwrap.dedent("""
    import json, re, sys
    from train import dry_run
    from train.config import config_from_dict
    from wedlm_jax.runtime.compiled import cost, estimate_options
    from wedlm_jax.runtime.targets import describe_target
    devices, _ = describe_target("v5p:1x1x1")
    cfg = config_from_dict(json.loads(sys.argv[1]), "the test config")
    mc = dry_run.model_config_for(cfg)
    out = {}
    for name, opts in (("plain", None), ("costed", estimate_options("tpu"))):
        c = dry_run.compile_step(cfg, mc, devices, scan_unroll=2, compiler_options=opts)[0]
        out[name] = dict(cost(c), sparsecore=len(re.findall("sparsecore", c.as_text())))
    print(json.dumps(out))
""")


def test_a_train_step_compiled_to_be_costed_gets_libtpus_time_estimate():
    """libtpu puts -2 s into optimal_seconds for each op it offloads to a SparseCore (the train
    step's scatters on v5p); the program compiled with `estimate_options` keeps them on the
    TensorCore and gets a time, with the same FLOPs (benchmarks.compiled.compile_for's train MFU)."""
    d = {"model": {"config": dict(TPU_MODEL)},
         "data": {"train_files": ["absent.jsonl"], "seq_len": 256, "global_batch_size": 1},
         "objective": {"kind": "dual_stream", "block_size": 32},
         "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "compute_dtype": "bf16", "remat": "full"}
    rc, out, err = _run([sys.executable, "-c", COSTED_TRAIN, json.dumps(d)])
    assert rc == 0, err[-4000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["plain"]["sparsecore"] > 0 and r["plain"]["optimal_seconds"] < 0, r
    assert r["costed"]["sparsecore"] == 0 and 0 < r["costed"]["optimal_seconds"] < 0.1, r
    assert r["costed"]["flops"] == pytest.approx(r["plain"]["flops"], rel=0.01)


COSTED_DECODE = textwrap.dedent("""
    import json, sys
    from jax.experimental import topologies
    from decode.compile.aot import compile_generate
    from decode.config import EngineOptions, Placement
    from wedlm_jax.runtime.compiled import estimate_options
    from wedlm_jax.config import ModelConfig
    dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:1x1x1",
                                       chips_per_host_bounds=(1, 1, 1)).devices[0]
    config = ModelConfig(**json.loads(sys.argv[1]))
    engine = EngineOptions(method="streaming", window=8, refill="after", slots=2, capacity=512)
    placement = Placement(dtype="bfloat16", attention="tiled", page_size=64,
                          weight_layout="compiler")
    out = {name: compile_generate(config, dev, engine, placement, compiler_options=options)
           for name, options in (("plain", None), ("costed", estimate_options("tpu")))}
    print(json.dumps({k: dict(v["cost"], layout=v["weight_layout"],
                              options=v["compiler_options"]) for k, v in out.items()}))
""")


def test_a_decode_step_compiles_for_tpu_with_the_estimate_options():
    """The decode step's costed compile takes `estimate_options` (libtpu knows each option; the
    weights' layouts chosen under them too): a time and the plain program's FLOPs."""
    from wedlm_jax.runtime.compiled import estimate_options
    rc, out, err = _run([sys.executable, "-c", COSTED_DECODE, json.dumps(TPU_MODEL)])
    assert rc == 0, err[-4000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["plain"]["layout"] == r["costed"]["layout"] == "compiler"
    assert r["costed"]["optimal_seconds"] > 0
    assert r["costed"]["flops"] == pytest.approx(r["plain"]["flops"], rel=0.01)
    # both under v5p's step options (decode.engine.planning.layouts.STEP_OPTIONS), the estimate's over them
    vmem = {"xla_tpu_scoped_vmem_limit_kib": 65536}
    assert r["plain"]["options"] == vmem, r
    assert r["costed"]["options"] == dict(vmem, **estimate_options("tpu")), r


def test_serve_dry_run_compiles_the_server_programs_for_a_topology(tmp_path):
    """`wedlm-serve --dry-run --topology` reads config.json alone, compiles the decode step and the
    prefill (with a paged cache, the admission into pages) for the chips laid out by --mesh /
    --dtype, and gives the verdict (0 fits, 1 does not, 2 bad input) in its own words."""
    from wedlm_jax.config import ModelConfig
    folder = tmp_path / "arch"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        ModelConfig(**TPU_MODEL, mask_token_id=511).to_hf_dict()))
    base = [sys.executable, "-m", "decode.serving.serve", "--checkpoint", str(folder), "--dry-run",
            "--slots", "4", "--capacity", "1024", "--window", "8", "--dtype", "bf16"]
    rc, out, err = _run(base + ["--topology", "v5p:2x2x2", "--mesh", "data=2"])
    assert rc == 0, out + err[-3000:]
    assert "wedlm-serve dry run for v5p:2x2x2: 2 of its 8 chips" in out
    assert "; paged cache, pages of 64 rows" in out    # slots over data: a pool per shard
    # v5p: the step under its generation's libtpu options (decode.engine.planning.layouts.STEP_OPTIONS)
    assert "; step compiled with xla_tpu_scoped_vmem_limit_kib=65536" in out
    # a paged door admits into pages: its admission program (prefill + first fill) is compiled
    assert "decode step" in out and "admission of a 1024-token prompt" in out
    assert "verdict      FITS in 95.00 GiB per chip" in out
    rc, out, err = _run(base + ["--topology", "v5p:1x1x1", "--device-memory", "0.001"])
    assert rc == 1 and "DOES NOT FIT" in out, out + err[-2000:]
    rc, out, err = _run(base + ["--topology", "v9x:2x2"])
    assert rc == 2 and "wedlm-serve: error: 'v9x:2x2': unknown target; accepted: TPU topologies" in err
    assert "Traceback" not in err
    # --enable-lora: the adapter table among the weights, in the default layout (TPU's auto is
    # the compiler's layouts otherwise); the compiler's layouts asked for with it are refused
    rc, out, err = _run(base + ["--topology", "v5p:1x1x1", "--enable-lora", "--max-loras", "2"])
    assert rc == 0 and "LoRA table 2 adapters x rank 16" in out, out + err[-3000:]
    assert "weights default layout" in out
    rc, out, err = _run(base + ["--topology", "v5p:1x1x1", "--enable-lora", "--weight-layout",
                                "compiler"])
    assert rc == 2 and "--enable-lora takes --weight-layout default or auto" in err, err[-2000:]


def _decode_dry_run_args(tmp_path) -> list[str]:
    """wedlm-decode --dry-run for v5p:1x1x1 on an architecture-only folder of TPU_MODEL."""
    from wedlm_jax.config import ModelConfig
    folder = tmp_path / "arch"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        ModelConfig(**TPU_MODEL, mask_token_id=511).to_hf_dict()))
    return [sys.executable, "-m", "decode.cli", "--checkpoint", str(folder), "--dry-run",
            "--slots", "4", "--capacity", "1024", "--window", "8", "--dtype", "bf16",
            "--topology", "v5p:1x1x1"]


# The decode dry runs are three tests (each a few compiles in subprocesses), not one: a single
# ~200 s test would hold one pytest-xdist worker while the other one idles at the suite's end.
def test_decode_dry_run_compiles_the_batch_jobs_programs_for_a_topology(tmp_path):
    """`wedlm-decode --dry-run --topology` (no prompts needed) compiles its programs the same way,
    in its own name, with the paged cache when --page-size asks for it; bad input is one line."""
    base = _decode_dry_run_args(tmp_path)
    rc, out, err = _run(base)
    assert rc == 0, out + err[-3000:]
    assert "wedlm-decode dry run for v5p:1x1x1: 1 of its 1 chips" in out
    assert "weights compiler layout" in out          # the prefill reads them as the step laid them
    assert "verdict      FITS" in out
    # no --page-size: on TPU the paged cache (the ragged kernel moves fewer bytes per step)
    assert "paged cache, pages of 64 rows (the platform's choice)" in out, out
    rc, out, err = _run(base + ["--page-size", "0"])
    assert rc == 0 and "; dense cache" in out and "verdict      FITS" in out, out + err[-3000:]
    assert "prefill of a 1024-token prompt" in out and "admission of" not in out


def test_decode_dry_run_with_pages_asked_for_and_a_pool_the_mesh_cannot_split(tmp_path):
    base = _decode_dry_run_args(tmp_path)
    rc, out, err = _run(base + ["--page-size", "64"])
    assert rc == 0 and "verdict      FITS" in out, out + err[-3000:]
    rc, out, err = _run(base + ["--page-size", "64", "--mesh", "data=2", "--topology", "v5p:2x2x2",
                                "--num-pages", "33"])
    assert rc == 2 and "num_pages 33 must be a multiple of the mesh's data x fsdp size 2" in err, \
        err[-2000:]
    assert "Traceback" not in err


def test_decode_dry_run_of_the_paged_pool_over_tensor_and_heads_it_cannot_tile(tmp_path):
    from wedlm_jax.config import ModelConfig
    # heads over tensor: the pool split by its K/V heads, the ragged kernel per device (shard_map)
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps(ModelConfig(**dict(
        TPU_MODEL, num_heads=8, num_kv_heads=4), mask_token_id=511).to_hf_dict()))
    rc, out, err = _run([sys.executable, "-m", "decode.cli", "--checkpoint", str(wide), "--dry-run",
                         "--slots", "4", "--capacity", "1024", "--window", "8", "--dtype", "bf16",
                         "--page-size", "64", "--mesh", "tensor=2", "--topology", "v5p:2x2x2"])
    assert rc == 0 and "verdict      FITS" in out, out + err[-3000:]
    # heads the TPU ragged kernel cannot tile (3 KV heads of float32: 6 interleaved rows) are
    # refused before anything compiles
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(ModelConfig(**dict(
        TPU_MODEL, num_heads=6, num_kv_heads=3), mask_token_id=511).to_hf_dict()))
    rc, out, err = _run([sys.executable, "-m", "decode.cli", "--checkpoint", str(odd), "--dry-run",
                         "--slots", "4", "--capacity", "1024", "--topology", "v5p:1x1x1",
                         "--page-size", "64"])
    assert rc == 2 and "cannot tile 3 KV heads" in err and "Traceback" not in err, err[-2000:]


def test_dry_runs_of_the_demo_model_for_a_tpu_take_the_dense_cache(tmp_path):
    """The demo model's heads are 64 values wide, which jax's TPU ragged paged attention kernel
    cannot read: its dry run for a TPU takes the dense cache (the platform's choice; wedlm-serve's
    door plans its cache the same way, `paged.auto_page_size` with continuous batching, checked in
    tests/test_paged_cache.py), and pages asked for by name are refused naming head_dim and the
    way out, in one line."""
    demo = os.path.join(ROOT, "demo", "model")
    rc, out, err = _run([sys.executable, "-m", "decode.cli", "--checkpoint", demo, "--dry-run",
                         "--topology", "v5p:1x1x1", "--slots", "2", "--capacity", "256"])
    assert rc == 0 and "; dense cache" in out and "verdict      FITS" in out, out + err[-3000:]
    serve = [sys.executable, "-m", "decode.serving.serve", "--checkpoint", demo, "--dry-run",
             "--topology", "v5p:1x1x1", "--slots", "2", "--capacity", "256"]
    rc, out, err = _run(serve + ["--page-size", "64"])
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    assert ("--page-size on tpu: the TPU ragged paged attention kernel reads heads of a multiple "
            "of 128 values; this model's head_dim is 64; use --page-size 0" in err), err[-2000:]
