"""Batch decoding on a mesh (batch over 'data', heads over 'tensor') gives the same tokens as one
device. Runs in a subprocess with 4 forced CPU devices (the flag must be set before jax starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json
    import jax
    import numpy as np
    from decode.config import DecodeConfig
    from decode.engine import generate
    from wedlm_jax.config import ModelConfig
    from synthetic import random_params
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
        one = generate(params, cfg, prompts, dc, capacity=40, kv_tile=16)
        sharded = generate(params, cfg, prompts, dc, capacity=40, kv_tile=16, mesh=mesh)
        out[method] = dict(one=one.tokens, sharded=sharded.tokens, one_steps=one.steps,
                           sharded_steps=sharded.steps, tpf=one.tokens_per_forward)
    # continuous batching on the mesh: 6 requests through 2 slots (one per data shard), inserted
    # into the sharded state as slots free; every request equals its own one-device decode
    from decode.batching import Batcher
    from decode.decoder import Decoder, Request
    reqs = [Request(prompt=tuple(p), max_new_tokens=n, tau=2.5, lam=0.05)
            for p, n in zip(prompts + prompts[:2], (12, 3, 9, 5, 7, 1))]
    got = {}
    dec = Decoder(params, cfg, window=4, slots=2, capacity=40, kv_tile=16, steps_per_call=3,
                  mesh=mesh, sampling=False)
    b = Batcher(dec)
    for r in reqs:
        b.submit(r, on_finish=lambda f: got.__setitem__(f.request_id, f.tokens))
    b.run_until_idle()
    alone = [generate(params, cfg, [list(r.prompt)],
                      DecodeConfig(window=4, tau=2.5, lam=0.05, max_new_tokens=r.max_new_tokens),
                      capacity=40, kv_tile=16).tokens[0] for r in reqs]
    out["batcher"] = dict(sharded=[got[i] for i in range(len(reqs))], one=alone)
    print("RESULT " + json.dumps(out))
''')


def test_mesh_data2_tensor2_same_tokens_as_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    batcher = out.pop("batcher")
    assert batcher["sharded"] == batcher["one"]
    for method, r in out.items():
        assert r["sharded"] == r["one"], method
        assert r["sharded_steps"] == r["one_steps"], method
        assert all(len(t) == 12 for t in r["one"]), method
    assert out["streaming"]["tpf"] > 1.0   # several tokens per forward: the window path is exercised
