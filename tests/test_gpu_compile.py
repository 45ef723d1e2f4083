"""The decode step compiled for an H100 by XLA's GPU compiler, no GPU needed: the Triton kernels
read the cache in place (dense and paged). (The step's bytes with the weights per layer or stacked,
measured with benchmarks/compiled/step_bytes.py's reading of the program, are its test:
benchmarks/tests/test_step_bytes.py.)

Needs XLA's GPU compiler, which `make setup` installs into .venv/gpu-compiler (`make
gpu-compiler` alone; tests/gpu_compiler.py)."""

from __future__ import annotations

import textwrap

from tests.gpu_compiler import run_for_the_gpu

SCRIPT_IN_PLACE = textwrap.dedent("""
    import json
    import jax
    from decode.compile import aot
    from decode.config import EngineOptions, Placement
    from wedlm_jax.attention import cache as ca
    from wedlm_jax.runtime.compiled import figures
    from wedlm_jax.config import ModelConfig
    from wedlm_jax.runtime.targets import describe_target
    config = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=True)
    dev = describe_target("h100")[0][0]
    out = {}
    static_int = ca._static_int
    for in_place in (True, False):
        ca._static_int = static_int if in_place else (lambda x: False)   # False: the layer's slice
        jax.clear_caches()                    # the programs are traced again under the patch
        for cap in (2048, 4096):          # both past 16 tiles: the same split count (auto_splits)
            dec, compiled = aot.generate_program(
                config, [dev], EngineOptions(method="streaming", window=16, slots=4, capacity=cap,
                                             prefill_chunk=16),
                Placement(dtype="bfloat16", attention="auto", page_size=0))
            f = figures(compiled)
            out[f"{in_place} {cap}"] = dict(temp=f["memory"]["temp"], attention=dec.static.attention,
                                            page_size=dec.static.page_size,
                                            triton="__gpu$xla.gpu.triton" in compiled.as_text())
    print("RESULT " + json.dumps(out))
""")


def test_the_triton_kernel_reads_the_cache_in_place_on_the_gpu():
    """The GPU's dense cache (a static batch's default; the Triton kernel, layers unrolled): the
    compiled step's temporaries do not grow with the capacity, i.e. no copy of a layer's K/V is
    made for the kernel. The same program with the layer's slice taken (the code before) grows with it. (Both
    capacities give the kernel the same splits: their partials are the same size.)"""
    out = run_for_the_gpu(SCRIPT_IN_PLACE)
    assert all(r["triton"] and r["page_size"] == 0 for r in out.values()), out
    layer_k = 4 * (4096 - 2048) * 2 * 128 * 2     # the K of one layer: 4 slots, 2 heads, bf16
    assert out["True 4096"]["temp"] == out["True 2048"]["temp"], out
    assert out["False 4096"]["temp"] - out["False 2048"]["temp"] >= layer_k, out


SCRIPT_PAGED = textwrap.dedent("""
    import json
    from decode.compile import aot
    from decode.config import EngineOptions, Placement
    from wedlm_jax.config import ModelConfig
    from wedlm_jax.runtime.targets import describe_target
    config = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=True)
    dev = describe_target("h100")[0][0]
    out = {}
    for cap in (2048, 4096):              # both past 16 pages a row: the same splits
        dec, compiled = aot.generate_program(
            config, [dev], EngineOptions(method="streaming", window=16, slots=4, capacity=cap),
            Placement(dtype="bfloat16", attention="auto", page_size=64))
        adm = aot.compile_admission(dec, 256)
        out[cap] = dict(temp=compiled.memory_analysis().temp_size_in_bytes,
                        attention=dec.static.attention,
                        kernel="wedlm_paged_attention" in compiled.as_text(),
                        admission_temp=adm["memory"]["temp"])
    for door, continuous in (("serve", True), ("static", False)):   # a door's dry run: its cache
        text, fits = aot.dry_run(config, "h100", EngineOptions(method="ar", window=1,
                                                               refill="after", slots=4,
                                                               capacity=512),
                                 Placement(dtype="bfloat16"), continuous=continuous)
        out[door] = dict(fits=fits, head=text.splitlines()[0])
    print("RESULT " + json.dumps(out))
""")


def test_the_paged_cache_on_the_gpu_steps_through_the_triton_paged_kernel_in_place():
    """A paged Decoder for an H100 (attention auto) takes the Triton paged kernel: the step and
    the admission (a prefill chunk and the first fill: query blocks) compile for the device, and
    the step's temporaries do not grow with the pool (read in place, no gathered tiles). A
    server's dry run for an H100 compiles that paged cache by default."""
    out = run_for_the_gpu(SCRIPT_PAGED)
    small, large = out["2048"], out["4096"]
    assert small["attention"] == large["attention"] == "pallas" and small["kernel"], out
    assert small["temp"] == large["temp"], out
    assert small["admission_temp"] == large["admission_temp"], out
    # the server's dry run for an H100 compiles its default cache, pages of 64; a static batch's
    # the dense cache
    assert out["serve"]["fits"] and "pages of 64 rows (the platform's choice)" in out["serve"]["head"]
    assert out["static"]["fits"] and out["static"]["head"].endswith("dense cache"), out


SCRIPT_TRAIN = textwrap.dedent("""
    import json, re, sys
    from tests.synthetic import train_data as fx
    from train import dry_run
    from train.config import load_config
    from train.step import attention_impl
    path = fx.write_config(sys.argv[1], fx.tiny_config_dict(
        {"train": "unused.jsonl", "tokenizer": "unused"}, **{"data.seq_len": 256}))
    dev = dry_run.describe_topology("h100")
    out = {}
    for attention in ("auto", "tiled"):                  # the tiny config's dual stream
        cfg = load_config(path, [f"attention={attention}", "compute_dtype=bf16"])
        compiled = dry_run.compile_step(cfg, dry_run.model_config_for(cfg), dev)[0]
        text = compiled.as_text()
        out[attention] = dict(
            impl=attention_impl(cfg, "gpu"), loops=text.count(" while("),
            kernels=sorted(set(re.findall(r"wedlm_flash_[a-z]+", text))))
    print("RESULT " + json.dumps(out))
""")


def test_the_train_step_on_the_gpu_runs_the_flash_kernels(tmp_path):
    """The dual-stream train step compiled for an H100 (attention auto) takes the Triton flash
    kernels (forward, dK/dV, dQ) and loses the tiled path's while loops over tiles (left: the
    layer scans and the tile plan's loop) that attention=tiled compiles. (The AR objective's
    structure takes the same resolver path: tests/test_flash_attention.py.)"""
    script = SCRIPT_TRAIN.replace("sys.argv[1]", repr(str(tmp_path / "cfg.yaml")))
    out = run_for_the_gpu(script)
    auto, tiled = out["auto"], out["tiled"]
    assert auto["impl"] == "pallas", out
    assert auto["kernels"] == ["wedlm_flash_dkv", "wedlm_flash_dq", "wedlm_flash_forward"], out
    assert tiled["impl"] == "tiled" and tiled["kernels"] == [], out
    assert auto["loops"] < tiled["loops"], out
