"""Batch decoding on a mesh (batch over 'data', heads over 'tensor') gives the same tokens as one
device, with the dense cache and with the paged one (a pool per slot shard), and with LoRA
adapters (the table replicated). Runs in a subprocess with 4 forced CPU devices (the flag must be set before jax starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from tests import xla

SCRIPT = textwrap.dedent('''
    import json
    import jax
    import numpy as np
    from decode.config import DecodeConfig, Placement
    from decode.static.static_batch import generate
    from wedlm_jax.config import ModelConfig
    from tests.synthetic import random_params
    from wedlm_jax.sharding import make_mesh

    assert len(jax.devices()) == 4, jax.devices()
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                      mask_token_id=63)
    params = random_params(cfg, seed=0, head_scale=30.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
    mesh = make_mesh(data=2, fsdp=1, tensor=2)
    out = {}
    for method in ("streaming", "ar"):
        dc = DecodeConfig(method=method, window=4, tau=2.5, lam=0.05, max_new_tokens=12)
        one = generate(params, cfg, prompts, dc, capacity=40, placement=Placement(kv_tile=16))
        sharded = generate(params, cfg, prompts, dc, capacity=40,
                           placement=Placement(kv_tile=16, mesh=(2, 1, 2)))
        out[method] = dict(one=one.tokens, sharded=sharded.tokens, one_steps=one.steps,
                           sharded_steps=sharded.steps, tpf=one.tokens_per_forward)
    # continuous batching on the mesh: 6 requests through 2 slots (one per data shard), inserted
    # into the sharded state as slots free; every request equals its own one-device decode
    from decode.engine.runtime.batcher import Batcher
    from decode.engine.step.state import Request
    from tests import plans
    reqs = [Request(prompt=tuple(p), max_new_tokens=n, tau=2.5, lam=0.05)
            for p, n in zip(prompts + prompts[:2], (12, 3, 9, 5, 7, 1))]

    def through_batcher(requests, slots=2, mesh=mesh, **kw):
        """(Batcher after the run, {request id: Finished}) of `requests` on a Decoder."""
        done = {}
        b = Batcher(plans.decoder(params, cfg, window=4, slots=slots, capacity=40, kv_tile=16,
                            steps_per_call=3, mesh=mesh, sampling=False, **kw))
        for r in requests:
            b.submit(r, on_finish=lambda f: done.__setitem__(f.request_id, f))
        b.run_until_idle()
        return b, done

    b, got = through_batcher(reqs)
    alone = [generate(params, cfg, [list(r.prompt)],
                      DecodeConfig(window=4, tau=2.5, lam=0.05, max_new_tokens=r.max_new_tokens),
                      capacity=40, placement=Placement(kv_tile=16)).tokens[0] for r in reqs]
    out["batcher"] = dict(sharded=[got[i].tokens for i in range(len(reqs))], one=alone)
    # the paged cache with heads over tensor (2 of the devices): the pool split by its K/V heads
    b, paged_got = through_batcher(reqs, mesh=make_mesh(data=1, fsdp=1, tensor=2,
                                                        devices=jax.devices()[:2]), page_size=8)
    out["paged_tensor2"] = dict(sharded=[paged_got[i].tokens for i in range(len(reqs))], one=alone,
                                pool_spec=str(b.state.cache.layers["pool"].sharding.spec))
    # slots over data (2 shards) and heads over tensor: a pool per slot shard; requests sharing a
    # 17-token prefix reuse its pages when they land on the shard that holds them
    from decode.config import DecodeConfigError
    prefix = list(range(20, 37))
    more = reqs + [Request(prompt=tuple(prefix + [40 + i]), max_new_tokens=6, tau=2.5, lam=0.05)
                   for i in range(3)]
    more_alone = alone + [generate(params, cfg, [list(r.prompt)], DecodeConfig(
        window=4, tau=2.5, lam=0.05, max_new_tokens=6), capacity=40, placement=Placement(kv_tile=16)).tokens[0]
        for r in more[len(reqs):]]
    b, got = through_batcher(more, slots=4, page_size=8)
    b.pool.check()
    errors = []
    try:
        plans.decoder(params, cfg, window=4, slots=4, capacity=40, mesh=mesh, page_size=8, num_pages=13)
    except DecodeConfigError as e:
        errors.append(str(e))
    small = Batcher(plans.decoder(params, cfg, window=4, slots=4, capacity=40, mesh=mesh, page_size=8,
                            num_pages=8, sampling=False))
    try:
        small.submit(Request(prompt=tuple(range(1, 30)), max_new_tokens=8))
    except DecodeConfigError as e:
        errors.append(str(e))
    static = generate(params, cfg, prompts, DecodeConfig(window=4, tau=2.5, lam=0.05, max_new_tokens=12),
                      capacity=40, placement=Placement(kv_tile=16), decoder=plans.decoder(params, cfg, window=4, slots=4, capacity=40,
                      kv_tile=16, mesh=mesh, sampling=False, page_size=8))
    out["paged_data2"] = dict(sharded=[got[i].tokens for i in range(len(more))], one=more_alone,
                              cached=[got[i].cached_tokens for i in range(len(more))], held=b.pool.num_held,
                              shards=[len(p._free) for p in b.pool.pools],
                              pool_spec=str(b.state.cache.layers["pool"].sharding.spec),
                              errors=errors, static=static.tokens)
    # a prefix cached in the other slot shard's pool is copied over (device to device), not
    # prefilled again: one slot per shard, the second request lands on shard 1
    cross = [Request(prompt=tuple(prefix + [40 + i]), max_new_tokens=n, tau=2.5, lam=0.05)
             for i, n in enumerate((12, 6, 6))]
    b, got = through_batcher(cross, slots=2, page_size=8)
    b.pool.check()
    out["paged_cross_shard"] = dict(
        sharded=[got[i].tokens for i in range(3)], cached=[got[i].cached_tokens for i in range(3)],
        held=b.pool.num_held, one=[generate(params, cfg, [list(r.prompt)], DecodeConfig(
            window=4, tau=2.5, lam=0.05, max_new_tokens=r.max_new_tokens), capacity=40,
            placement=Placement(kv_tile=16)).tokens[0] for r in cross])
    # the other methods on the pools per slot shard: each request as it decodes alone
    out["paged_data2_methods"] = {}
    for method, refill in (("block", "before"), ("ar", "after"), ("verified", "after")):
        b, got = through_batcher(reqs[:4], slots=4, page_size=8, method=method, refill=refill)
        out["paged_data2_methods"][method] = dict(sharded=[got[i].tokens for i in range(4)], one=[
            generate(params, cfg, [list(r.prompt)], DecodeConfig(
                method=method, refill=refill, window=4, tau=2.5, lam=0.05,
                max_new_tokens=r.max_new_tokens), capacity=40, placement=Placement(kv_tile=16)).tokens[0]
            for r in reqs[:4]], held=b.pool.num_held)
    # LoRA adapters on the mesh (the adapter table replicated): an adapter and the base in one
    # continuous batch, each request as on one device
    import tempfile
    from decode.lora_options import LoraOptions
    from wedlm_jax.lora import apply as lora_lib
    from wedlm_jax.lora.spec import LoraSpec
    from wedlm_jax.lora.peft import save_peft
    spec = LoraSpec(rank=4, alpha=8.0, targets=("all-linear",))
    rng = np.random.default_rng(5)
    tree = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32),
                        lora_lib.adapter_shapes(cfg, spec))
    folder = save_peft(cfg, tree, spec, tempfile.mkdtemp() + "/a", base="toy")

    def adapted(on_mesh, names):
        dec = plans.decoder(params, cfg, window=4, slots=4, capacity=40, kv_tile=16,
                            steps_per_call=3, mesh=on_mesh, sampling=False,
                            lora=LoraOptions(enable_lora=True, max_loras=2, max_lora_rank=4))
        dec.adapters.load("a", folder)
        done, b = {}, Batcher(dec)
        for r, name in zip(reqs[:4], names):
            b.submit(r, on_finish=lambda f: done.__setitem__(f.request_id, f.tokens), adapter=name)
        b.run_until_idle()
        return [done[i] for i in range(4)]

    names = ["a", None, "a", None]
    out["lora"] = dict(sharded=adapted(mesh, names), one=adapted(None, names), base=alone[:4])
    # one weight tree per layer (what a GPU Decoder holds, decode/engine/planning/layouts.py), laid out on the mesh
    from decode.engine.planning import layouts
    layouts.layers_stacked = lambda platform, grouped_kernel=False: False
    b, flat_got = through_batcher(reqs)
    kernel = b.decoder.params["layer_0"]["mlp"]["gate_proj"]["kernel"]
    out["per_layer_weights"] = dict(sharded=[flat_got[i].tokens for i in range(len(reqs))], one=alone,
                                    spec=str(kernel.sharding.spec))
    print("RESULT " + json.dumps(out))
''')


def test_mesh_data2_tensor2_same_tokens_as_one_device():
    env = dict(os.environ, XLA_FLAGS=xla.flags(4), JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    batcher = out.pop("batcher")
    assert batcher["sharded"] == batcher["one"]
    paged = out.pop("paged_tensor2")
    assert paged["sharded"] == paged["one"]
    assert paged["pool_spec"] == "P(None, None, 'tensor')", paged["pool_spec"]
    for method, r in out.pop("paged_data2_methods").items():
        assert r["sharded"] == r["one"] and r["held"] == 0, method
    lora = out.pop("lora")
    assert lora["sharded"] == lora["one"]
    assert [lora["one"][i] for i in (1, 3)] == [lora["base"][i] for i in (1, 3)]   # the base rows
    assert any(lora["one"][i] != lora["base"][i] for i in (0, 2))      # the adapter changes tokens
    flat = out.pop("per_layer_weights")
    assert flat["sharded"] == flat["one"] and flat["spec"] == "P(None, 'tensor')", flat["spec"]
    cross = out.pop("paged_cross_shard")
    assert cross["sharded"] == cross["one"] and cross["held"] == 0
    assert cross["cached"][:2] == [0, 16], cross["cached"]   # the 2nd: 2 pages copied from shard 0
    shards = out.pop("paged_data2")
    assert shards["sharded"] == shards["one"]
    assert shards["static"] == out["streaming"]["one"]       # the static batch on the pools too
    assert shards["pool_spec"] == "P('data', None, 'tensor')", shards["pool_spec"]
    assert shards["held"] == 0 and len(shards["shards"]) == 2
    assert max(shards["cached"][-3:]) == 16, shards["cached"]     # 2 full pages of the prefix
    assert "num_pages 13 must be a multiple of the mesh's data x fsdp size 2" in shards["errors"][0]
    assert "each of the 2 slot shards' pools holds 4" in shards["errors"][1], shards["errors"]
    for method, r in out.items():
        assert r["sharded"] == r["one"], method
        assert r["sharded_steps"] == r["one_steps"], method
        assert all(len(t) == 12 for t in r["one"]), method
    assert out["streaming"]["tpf"] > 1.0   # several tokens per forward: the window path is exercised


DOORS = textwrap.dedent('''
    import contextlib, io, json, sys
    import jax
    from decode import cli
    from tests.tiny_checkpoint import make_checkpoint
    assert len(jax.devices()) == 4, jax.devices()
    root = sys.argv[1]
    path = make_checkpoint(root)[0]
    prompts = root + "/p.jsonl"
    with open(prompts, "w") as f:
        for p in ("count with me", "the cat sat", "hello world", "one two"):
            f.write(json.dumps(p) + "\\n")
    lines = root + "/in.jsonl"
    with open(lines, "w") as f:
        for i, p in enumerate(("count with me", "the cat sat", "hello world", "one two", "six")):
            f.write(json.dumps({"id": i, "prompt": p, "max_tokens": 10, "tau": 0.5}) + "\\n")

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(argv))
        return code, out.getvalue(), err.getvalue()

    res = {}
    base = ["--checkpoint", path, "--prompts-file", prompts, "--json", "--max-new-tokens", "10",
            "--no-default-stops", "--window", "4"]
    for name, extra in (("one", []), ("tensor2", ["--mesh", "tensor=2"]),
                        ("data2_tensor2", ["--mesh", "data=2,tensor=2"]),
                        ("tiles", ["--attention", "dense", "--kv-tile", "16"])):
        code, out, err = run(*base, *extra)
        assert code == 0, err
        res[name] = [r["ids"] for r in json.loads(out)["results"]]
    for name, extra in (("job_one", []), ("job_data2", ["--mesh", "data=2"])):
        out_file = f"{root}/{name}.jsonl"
        code, _, err = run("--checkpoint", path, "--input", lines, "--output", out_file,
                           "--slots", "2", "--no-default-stops", "--window", "4", *extra)
        assert code == 0, err
        res[name] = sorted((json.loads(l)["id"], json.loads(l)["text"]) for l in open(out_file))
    # wedlm-serve on a mesh: the same greedy completions as on one device
    from fastapi.testclient import TestClient
    from decode.serving import serve
    from decode.engine.runtime.batcher import Batcher
    for name, extra in (("serve_one", []), ("serve_data2_tensor2", ["--mesh", "data=2,tensor=2"])):
        args = serve._parser().parse_args(["--checkpoint", path, "--slots", "2", "--window", "4",
                                           "--capacity", "64", "--no-default-stops",
                                           "--model-name", "tiny", *extra])
        serve._check_args(args)
        decoder, tokenizer, cfg = serve.load_decoder(args)
        engine = serve.EngineThread(Batcher(decoder), max_pending=4,
                                    scorer=serve.scorer_for(decoder)).start()
        client = TestClient(serve.build_app(engine, tokenizer, cfg))
        res[name] = [client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 10,
                                                           "tau": 0.5}).json()["choices"][0]["text"]
                     for p in ("count with me", "the cat sat", "hello world")]
        engine.shutdown(timeout=15)
    res["bad"] = [run(*base, *extra)[2].strip().splitlines()[-1] for extra in (
        ["--mesh", "tensor=3"], ["--mesh", "data=8"], ["--mesh", "model=2"], ["--dtype", "fp8"],
        ["--attention", "flash"])]
    res["bad_job"] = run("--checkpoint", path, "--input", lines, "--output", root + "/x.jsonl",
                         "--slots", "3", "--window", "4", "--mesh", "data=2")[2].strip().splitlines()[-1]
    print("RESULT " + json.dumps(res))
''')


def test_every_door_takes_the_mesh_dtype_and_attention(tmp_path):
    """wedlm-decode, the batch job and wedlm-serve with --mesh (heads over tensor, slots over data)
    give the same tokens as one device; --attention / --kv-tile reach the Decoder; a mesh the devices or the
    model cannot take, or an unknown dtype / backend, is refused in one line."""
    env = dict(os.environ, XLA_FLAGS=xla.flags(4), JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", DOORS, str(tmp_path)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    assert all(len(ids) == 10 for ids in r["one"])
    assert r["tensor2"] == r["one"] and r["data2_tensor2"] == r["one"] and r["tiles"] == r["one"]
    assert r["job_data2"] == r["job_one"] and len(r["job_one"]) == 5
    assert r["serve_data2_tensor2"] == r["serve_one"] and all(r["serve_one"])
    # the server's greedy text is the batch job's for the same prompt and settings
    assert r["serve_one"] == [t for _, t in r["job_one"][:3]]
    assert r["bad"] == [
        "wedlm-decode: error: --mesh tensor=3 does not divide the model's 4 heads / 2 KV heads",
        "wedlm-decode: error: --mesh data=8,fsdp=1,tensor=1 needs 8 devices; 4 cpu device(s) here",
        "wedlm-decode: error: --mesh 'model=2': expected comma-separated AXIS=N with AXIS one of "
        "data, fsdp, tensor and N >= 1 (e.g. data=2,tensor=4)",
        "wedlm-decode: error: dtype 'fp8' is unknown; allowed: float32, bfloat16 (f32, fp32, bf16)",
        "wedlm-decode: error: attention 'flash' is unknown; allowed: auto, tiled, dense, cudnn, pallas"]
    assert r["bad_job"] == "wedlm-decode: error: --slots 3 must be a multiple of the mesh's data x fsdp = 2"
