"""The int8 KV cache (wedlm_jax/attention/kv_quant.py, `--kv-dtype int8`): a row and its scale
round trip within half a step, the dense / tiled / paged-gather reads agree with each other and
stay close to the float cache, the paged int8 cache under continuous batching with prefix reuse
gives the dense int8 cache's tokens, the kernels and bad settings are refused naming the setting,
and on the demo model greedy AR keeps the float cache's continuation."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.config import DecodeConfig, DecodeConfigError, Placement
from decode.engine.planning.plan import int8_cache
from decode.static.static_batch import generate
from tests import plans
from tests.decode_cases import CONFIG as PAGED_CONFIG, paged_requests, run_requests
from tests.quantize_cases import AR_TOKENS, CONFIG, prefix_length
from wedlm_jax import model as model_lib
from wedlm_jax.attention import cache as ca
from wedlm_jax.attention import kv_quant, paged
from tests.synthetic import random_params


# ---------------------------------------------------------------------------- rows and scales

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_round_trip_is_within_half_a_step(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 2, 64)) * 3, dtype)
    x = x.at[0, 0, 0].set(0)                                 # an all-zero row stays zero
    packed = kv_quant.pack(x)
    assert packed.dtype == jnp.int8 and packed.shape == (3, 5, 2, 64 + kv_quant.SCALE_BYTES)
    back = kv_quant.unpack(packed, jnp.float32)
    xf = x.astype(jnp.float32)
    step = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / kv_quant.QMAX
    assert float(jnp.max(jnp.abs(back - xf) - step / 2)) <= 1e-6
    assert not bool(jnp.any(back[0, 0, 0])) and bool(jnp.all(jnp.isfinite(back)))
    assert kv_quant.row_bytes(64, jnp.int8) == 68 and kv_quant.row_bytes(64, jnp.bfloat16) == 128


def _forward(cache, attention="tiled", split=16):
    """Two cache-mode forwards (a prompt of `split` rows, then 8 more) of the random Qwen3-shaped
    model: the second forward's logits."""
    params = model_lib.random_params(CONFIG, head_scale=4.0)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, 255, (2, split + 8)))
    pos = jnp.broadcast_to(jnp.arange(split + 8), toks.shape)
    m = model_lib.Transformer(CONFIG, attention=attention, kv_tile=8)
    run = lambda a, b, cache, n: m.apply({"params": params}, toks[:, a:b], pos[:, a:b],
                                         kv_cache=cache, cache_len=jnp.full((2,), n, jnp.int32))
    _, cache = run(0, split, cache, 0)
    return run(split, split + 8, cache, split)[0]


def _kl(a, b):
    pa, pb = jax.nn.log_softmax(a), jax.nn.log_softmax(b)
    return float((jnp.exp(pa) * (pa - pb)).sum(-1).mean())


def test_model_reads_the_int8_cache_alike_on_every_xla_path():
    ref = _forward(model_lib.init_kv_cache(CONFIG, 2, 64))
    tiled = _forward(model_lib.init_kv_cache(CONFIG, 2, 64, jnp.int8))
    dense = _forward(model_lib.init_kv_cache(CONFIG, 2, 64, jnp.int8), "dense")
    pool = paged.init_paged_cache(CONFIG.num_layers, 16, 8, CONFIG.num_kv_heads, CONFIG.head_dim,
                                  2, 8, jnp.int8)
    pages = _forward(dict(pool, table=jnp.arange(16, dtype=jnp.int32).reshape(2, 8)))
    np.testing.assert_allclose(dense, tiled, atol=2e-5)
    np.testing.assert_allclose(pages, tiled, atol=2e-5)
    kl = _kl(ref, tiled)
    print(f"random Qwen3-shaped model, int8 KV cache, mean KL per token vs float32: {kl:.2e}")
    assert 0 < kl < 1e-3


def test_paged_int8_with_prefix_reuse_gives_the_dense_int8_tokens():
    params = random_params(PAGED_CONFIG, seed=2, head_scale=20.0)
    reqs = paged_requests(10, seed=3)
    make = lambda **kw: plans.decoder(params, PAGED_CONFIG, method="streaming", window=4,
                                      slots=4, capacity=96, steps_per_call=3, kv_tile=16,
                                      kv_dtype="int8", **kw)
    dense, _ = run_requests(make(), reqs)
    pages, b = run_requests(make(page_size=8), reqs)
    assert b.decoder.static.cache_dtype == jnp.int8
    assert [pages[i].tokens for i in range(len(reqs))] == [dense[i].tokens
                                                           for i in range(len(reqs))]
    assert sum(f.cached_tokens for f in pages.values()) > 0          # prefixes were reused


# ---------------------------------------------------------------------------- refusals

def test_kernels_refuse_the_int8_cache():
    q = jnp.zeros((1, 2, 4, 32))
    k = jnp.zeros((1, 64, 2, 36), jnp.int8)
    with pytest.raises(ValueError, match="kv_dtype int8 is not read by the pallas cache attention "
                                         "kernel; use attention 'tiled'"):
        ca.attend_cache("pallas", q, k, k, jnp.zeros((1,), jnp.int32), 1.0, interpret=True)
    pool = jnp.zeros((8, 8, 4, 36), jnp.int8)
    with pytest.raises(ValueError, match="not read by the Triton paged kernel"):
        paged.attend_pages("triton", q, pool, jnp.zeros((1, 8), jnp.int32), jnp.zeros((1,)), 1.0)


def test_plan_takes_the_xla_paths_and_refuses_kernels_by_name():
    dec = plans.decoder(model_lib.random_params(CONFIG), CONFIG, method="ar", slots=2,
                        capacity=64, kv_dtype="int8")
    assert dec.static.attention == "tiled" and dec.static.cache_dtype == jnp.int8
    floats = plans.plan(CONFIG, method="ar", slots=2, capacity=64)
    item = (CONFIG.head_dim + kv_quant.SCALE_BYTES) / (4 * CONFIG.head_dim)
    assert dec.memory_estimate["cache"] == floats.memory_estimate["cache"] * item
    for attention, kernel in (("pallas", "Pallas \\(Triton\\) cache kernels"),
                              ("cudnn", "cuDNN attention")):
        with pytest.raises(DecodeConfigError, match=f"--kv-dtype int8 is not read by the {kernel}; "
                                                    "use --attention tiled or auto") as e:
            plans.plan(CONFIG, method="ar", capacity=64, kv_dtype="int8", attention=attention)
        assert e.value.field == "kv_dtype"
    assert int8_cache("auto", "tpu", 64, True) == ("tiled", 0)      # TPU: the dense cache
    with pytest.raises(DecodeConfigError, match="TPU ragged paged attention kernel; use "
                                                "--page-size 0"):
        int8_cache("auto", "tpu", 64, False)
    with pytest.raises(DecodeConfigError, match="kv_dtype 'int4' is unknown; allowed: auto, "
                                                "int8") as e:
        Placement(kv_dtype="int4")
    assert e.value.field == "kv_dtype"


# ---------------------------------------------------------------------------- the demo model

def _cache_kl(config, params, prompts, continuations) -> float:
    """Mean KL(float cache || int8 cache) per continuation token, teacher-forced on the float
    tokens: one cache-mode forward of each row (each row's K/V quantized as decoding writes it)."""
    rows = [p + c for p, c in zip(prompts, continuations)]
    width = max(map(len, rows))
    ids = jnp.asarray([r + [0] * (width - len(r)) for r in rows])
    pos = jnp.broadcast_to(jnp.arange(width), ids.shape)
    model = model_lib.Transformer(config, attention="tiled")

    def logp(dtype):
        cache = model_lib.init_kv_cache(config, len(rows), width, dtype)
        out, _ = model.apply({"params": params}, ids, pos, kv_cache=cache,
                             cache_len=jnp.zeros((len(rows),), jnp.int32))
        return jax.nn.log_softmax(out)
    a, b = logp(jnp.float32), logp(jnp.int8)
    kl = (jnp.exp(a) * (a - b)).sum(-1)
    return float(jnp.concatenate([kl[i, len(p) - 1:len(r) - 1]
                                  for i, (p, r) in enumerate(zip(prompts, rows))]).mean())


def test_demo_greedy_ar_int8_cache_keeps_the_continuation(demo_prompts):
    config, params, prompts = demo_prompts
    dc = DecodeConfig(method="ar", max_new_tokens=AR_TOKENS)
    base = generate(params, config, prompts, dc).tokens
    out = generate(params, config, prompts, dc, placement=Placement(kv_dtype="int8")).tokens
    shared = [prefix_length(a, b) / AR_TOKENS for a, b in zip(base, out)]
    report = dict(common_prefix=shared, mean_common_prefix=float(np.mean(shared)),
                  mean_kl_per_token=_cache_kl(config, params, prompts, base))
    print("demo model, greedy AR, 48 tokens, int8 KV cache vs float32:", json.dumps(report))
    assert min(shared) >= 0.8, report
    assert report["mean_kl_per_token"] < 1e-3, report


# ---------------------------------------------------------------------------- the doors

def test_doors_decode_with_the_int8_cache(ckpt, tmp_path, capsys, monkeypatch):
    from decode import cli
    from decode.engine.runtime import decoder as decoder_lib
    from decode.text import load_tokenizer
    from tests.batch_lines import write_jsonl
    path, config, params = ckpt
    made = []
    real_init = decoder_lib.Decoder.__init__
    monkeypatch.setattr(decoder_lib.Decoder, "__init__",
                        lambda self, p, plan: (made.append(plan), real_init(self, p, plan))[1])
    ids = load_tokenizer(path).encode("one two three")
    dc = DecodeConfig(method="ar", max_new_tokens=8)
    want = generate(params, config, [ids], dc, placement=Placement(kv_dtype="int8")).tokens[0]
    assert cli.main(["--checkpoint", path, "--prompt", "one two three", "--method", "ar",
                     "--max-new-tokens", "8", "--kv-dtype", "int8", "--json",
                     "--no-default-stops"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["ids"] == want
    assert made[-1].static.cache_dtype == jnp.int8
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "one two three",
                                               "max_tokens": 8}])
    out = tmp_path / "out.jsonl"
    assert cli.main(["--checkpoint", path, "--input", src, "--output", str(out), "--method", "ar",
                     "--kv-dtype", "int8", "--no-default-stops"]) == 0, capsys.readouterr().err
    assert made[-1].static.paged and made[-1].static.cache_dtype == jnp.int8   # pages on CPU
    assert json.loads(out.read_text())["token_ids"] == want


def test_door_refuses_a_kernel_with_the_int8_cache_in_one_line(ckpt, capsys):
    from decode import cli
    code = cli.main(["--checkpoint", ckpt[0], "--prompt", "one two", "--kv-dtype", "int8",
                     "--attention", "cudnn"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("wedlm-decode: error: --kv-dtype int8 is not read by the cuDNN "
                                 "attention; use --attention tiled or auto"), err
