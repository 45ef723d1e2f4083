"""Tile-skipping attention (wedlm_jax.attention.tiled) and implementation selection
(wedlm_jax.attention.backends) against the dense masked reference `attention.attend`."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from wedlm_jax import masking
from wedlm_jax.attention import backends as ab, core as attention
from wedlm_jax import model as model_lib
from wedlm_jax.attention import tiled as ta
from tests.attention_cases import (SETTINGS, TINY, arranged_batch, assert_close, packed_rows,
                                   qkv, structure_of)
from wedlm_jax.config import ConfigError


def _value_and_vjp(fn, q, k, v, w):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + vjp(w)


@functools.partial(jax.jit, static_argnames=("scale", "tq", "tk"))
def dense_and_tiled(q, k, v, w, qs, ks, mask, scale, tq, tk):
    """(out, dq, dk, dv) of the dense reference and of the tiled path, loss sum(out * w)."""
    dense = _value_and_vjp(lambda q, k, v: attention.attend(q, k, v, mask, scale), q, k, v, w)
    tiled = _value_and_vjp(lambda q, k, v: ta.tiled_attention(q, k, v, qs, ks, scale,
                                                              tile_q=tq, tile_k=tk), q, k, v, w)
    return dense, tiled


# ------------------------------------------------------------------------------ the rule

@settings(max_examples=15, **SETTINGS)
@given(data=st.data(), layout=st.sampled_from(["dual", "plain", "ar", "causal"]),
       length=st.sampled_from([1, 9, 24]), block_size=st.integers(1, 6))
def test_pair_mask_is_the_structure_mask(data, layout, length, block_size):
    seg = data.draw(packed_rows(2, length))
    s = structure_of(layout, seg, block_size)
    np.testing.assert_array_equal(ta.pair_mask(s, s), masking.structure_mask(s))
    if layout == "causal":
        np.testing.assert_array_equal(ta.pair_mask(s, s),
                                      attention.segment_mask(jnp.asarray(seg), 2, length))


# ------------------------------------------------------------------- values and gradients

@settings(max_examples=10, **SETTINGS)
@given(data=st.data(), layout=st.sampled_from(["dual", "plain", "ar", "causal"]),
       block_size=st.integers(1, 8))
def test_forward_and_gradients_equal_dense(data, layout, block_size):
    """Random packings, paddings and block sizes are runtime data of fixed shapes (rows of 12
    tokens: 24 slots dual-stream, 12 otherwise), so one compilation serves many structures.
    Tiles 8 x 4 (the 12-slot case pads the queries to 16); GQA 4 heads on 2 KV heads."""
    h, kvh, tq, tk = 4, 2, 8, 4
    seg = data.draw(packed_rows(2, 12))
    s = structure_of(layout, seg, block_size)
    t = s["segment"].shape[1]
    q, k, v, w = qkv(data.draw(st.integers(0, 99)), 2, t, t, h, kvh, 8)
    ref, got = dense_and_tiled(q, k, v, w, s, s, masking.structure_mask(s), scale=0.3, tq=tq,
                               tk=tk)
    for a, e in zip(got, ref):
        assert_close(a, e)


@settings(max_examples=4, **SETTINGS)
@given(lens=st.lists(st.integers(0, 40), min_size=2, max_size=2), new=st.sampled_from([1, 5]))
def test_query_window_structures_equal_dense(lens, new):
    """Queries and keys with different structures (a query window over a cache: query i of row b
    has index cache_len[b] + i, cache row t has index t), 3 query heads on 1 KV head; capacity 49
    is not a multiple of the tile. The kernel is generic; cache-mode decoding itself runs
    `attention.cache` (tests/test_decode_attention.py)."""
    capacity, tk = 49, 8
    cache_len = jnp.asarray(lens, jnp.int32)
    ones = lambda n: jnp.ones((2, n), jnp.int32)
    qs = {"segment": ones(new), "stream": 0 * ones(new), "block": 0 * ones(new),
          "index": attention.cache_last_key(cache_len, new)}
    ks = {"segment": ones(capacity), "stream": 0 * ones(capacity), "block": 0 * ones(capacity),
          "index": jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (2, capacity))}
    np.testing.assert_array_equal(ta.pair_mask(qs, ks),
                                  attention.cache_mask(cache_len, new, capacity))
    q, k, v, w = qkv(1, 2, new, capacity, 3, 1, 8)
    mask = attention.cache_mask(cache_len, new, capacity)
    ref, got = dense_and_tiled(q, k, v, w, qs, ks, mask, scale=0.5, tq=8, tk=tk)
    for a, e in zip(got, ref):
        assert_close(a, e)
    # keys past cache_len + new are never in a computed tile's allowed set: with the tile plan,
    # the tiles wholly past the longest row are skipped
    plan = ta.tile_plan(qs, ks, 8, tk)
    need = -(-(max(lens) + new) // tk)
    assert int(jnp.max(plan.kv_count)) == need


def test_padding_rows_output_zero_with_finite_gradients():
    seg = np.asarray([[1] * 9 + [0] * 7, [0] * 5 + [2] * 11], np.int32)
    s = ta.dual_stream_structure(seg, 4)
    q, k, v, w = qkv(3, 2, 32, 32, 4, 2, 8)
    fn = lambda q, k, v: ta.tiled_attention(q, k, v, s, s, 0.3, tile_q=8, tile_k=8)
    out, dq, dk, dv = jax.jit(lambda *a: _value_and_vjp(fn, *a))(q, k, v, w)
    pad = np.asarray(s["segment"]) == 0
    assert pad.sum() == 24
    np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_array_equal(np.asarray(dq)[pad], 0.0)     # padding queries: no gradient
    np.testing.assert_array_equal(np.asarray(dk)[pad], 0.0)     # padding keys: seen by nobody
    np.testing.assert_array_equal(np.asarray(dv)[pad], 0.0)


def test_bf16_inputs_close_to_dense():
    s = ta.dual_stream_structure(np.ones((1, 40), np.int32), 8)
    q, k, v, _ = qkv(4, 1, 80, 80, 4, 2, 16, jnp.bfloat16)
    mask = masking.structure_mask(s)
    out = jax.jit(lambda q, k, v: ta.tiled_attention(q, k, v, s, s, 0.25, tile_q=16,
                                                     tile_k=16))(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = attention.attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                           mask, 0.25)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------- tile skipping

def brute_force_state(mask, tq, tk):
    """EMPTY / PARTIAL / FULL per tile pair from a dense mask [B, S, T] (padded with False)."""
    b, s, t = mask.shape
    sp, tp = -(-s // tq) * tq, -(-t // tk) * tk
    m = np.zeros((b, sp, tp), bool)
    m[:, :s, :t] = mask
    m = m.reshape(b, sp // tq, tq, tp // tk, tk)
    any_, all_ = m.any(axis=(2, 4)), m.all(axis=(2, 4))
    return np.where(all_, ta.FULL, np.where(any_, ta.PARTIAL, ta.EMPTY))


_tile_plan = jax.jit(ta.tile_plan, static_argnums=(2, 3))


@settings(max_examples=8, **SETTINGS)
@given(data=st.data(), layout=st.sampled_from(["dual", "plain", "causal"]),
       length=st.sampled_from([5, 24]), block_size=st.integers(1, 9),
       tq=st.sampled_from([1, 3, 8, 40]), tk=st.sampled_from([2, 5, 16]))
def test_occupancy_equals_brute_force(data, layout, length, block_size, tq, tk):
    seg = data.draw(packed_rows(2, length))
    s = structure_of(layout, seg, block_size)
    t = s["segment"].shape[1]
    plan = _tile_plan(s, s, tq, tk)
    tq, tk = ta.tile_sizes(t, t, tq, tk)
    expected = brute_force_state(np.asarray(masking.structure_mask(s)), tq, tk)
    np.testing.assert_array_equal(plan.state, expected)
    counts = ta.plan_counts(plan)
    assert counts["empty"] == int((expected == ta.EMPTY).sum())
    assert counts["full"] == int((expected == ta.FULL).sum())
    active = expected != ta.EMPTY
    np.testing.assert_array_equal(plan.kv_count, active.sum(-1))
    np.testing.assert_array_equal(plan.q_count, active.sum(-2))
    for bi in range(2):
        for i in range(active.shape[1]):
            listed = np.asarray(plan.kv_index[bi, i, :int(plan.kv_count[bi, i])])
            np.testing.assert_array_equal(listed, np.flatnonzero(active[bi, i]))


def test_dual_stream_skips_about_three_quarters():
    s = ta.dual_stream_structure(np.ones((1, 1024), np.int32), 32)
    counts = ta.plan_counts(ta.tile_plan(s, s, 128, 128))
    assert counts["total"] == 256
    # memory causal 36 tiles, prediction->memory staircase 36, prediction diagonal 8
    assert counts["total"] - counts["empty"] == 80
    assert counts["full"] == 28 + 28 + 0


def test_empty_tiles_are_never_read():
    """Poison (NaN) the keys and values of every key tile that is EMPTY for query tile i: the
    tiled output and dq of tile i stay exactly those of clean inputs, while the dense reference
    (which touches every key) turns NaN. Reading a skipped tile, even masked, would give NaN."""
    seg = np.asarray([[1] * 20 + [2] * 12], np.int32)
    s = ta.dual_stream_structure(seg, 4)
    q, k, v, w = qkv(5, 1, 64, 64, 4, 2, 8)
    tq = tk = 8
    plan = ta.tile_plan(s, s, tq, tk)
    fn = lambda q, k, v: ta.tiled_attention(q, k, v, s, s, 0.3, plan=plan)

    @jax.jit
    def out_and_dq(q, k, v, w):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(w)[0]

    dense = jax.jit(lambda k, v: attention.attend(q, k, v, masking.structure_mask(s), 0.3))
    checked = 0
    for i in range(8):
        empty = np.flatnonzero(np.asarray(plan.state[0, i]) == ta.EMPTY)
        if len(empty) == 0:
            continue
        rows = np.concatenate([np.arange(j * tk, (j + 1) * tk) for j in empty])
        kp, vp = k.at[:, rows].set(jnp.nan), v.at[:, rows].set(jnp.nan)
        sl = slice(i * tq, (i + 1) * tq)
        wi = jnp.zeros_like(w).at[:, sl].set(w[:, sl])
        out, dq = out_and_dq(q, kp, vp, wi)
        clean, dq_clean = out_and_dq(q, k, v, wi)
        np.testing.assert_array_equal(out[:, sl], clean[:, sl])
        np.testing.assert_array_equal(dq[:, sl], dq_clean[:, sl])
        assert np.isnan(np.asarray(dense(kp, vp)[:, sl])).all()
        checked += 1
    assert checked >= 6


# ----------------------------------------------------------------------- model level

def test_model_structure_entry_is_the_explicit_mask():
    params = model_lib.init_params(TINY, jax.random.key(0))
    arr = arranged_batch("dual")
    m = model_lib.Transformer(TINY)
    explicit = jax.jit(lambda p: m.apply({"params": p}, arr["tokens"], arr["positions"],
                                         mask=masking.structure_mask(arr)))(params)
    via_structure = jax.jit(lambda p: m.apply({"params": p}, arr["tokens"], arr["positions"],
                                              structure=arr))(params)
    np.testing.assert_array_equal(explicit, via_structure)


def test_model_causal_packed_and_cache_mode_tiled_equal_dense():
    params = model_lib.init_params(TINY, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, 60)
    positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
    seg = jnp.asarray([[1] * 7 + [2] * 13, [1] * 15 + [0] * 5], jnp.int32)
    cache = model_lib.init_kv_cache(TINY, 2, 32)
    cache_len = jnp.asarray([11, 6], jnp.int32)

    @jax.jit
    def run(params):
        """auto (CPU -> tiled) and dense: packed causal logits; cache mode: prefill 20 slots,
        then 5 new slots at cache_len."""
        outs = []
        for impl in ("auto", "dense"):
            m = model_lib.Transformer(TINY, attention=impl, attention_tile=8)
            apply = lambda *a, **kw: m.apply({"params": params}, *a, **kw)
            packed = apply(tokens, positions, segment_ids=seg)
            _, filled = apply(tokens, positions, kv_cache=cache,
                              cache_len=jnp.zeros(2, jnp.int32))
            step = apply(tokens[:, :5], cache_len[:, None] + jnp.arange(5)[None],
                         kv_cache=filled, cache_len=cache_len)
            outs.append((packed, step))
        return outs

    tiled, dense = run(params)
    jax.tree.map(assert_close, tiled, dense)


# ----------------------------------------------------------------------- selection

def test_selection_by_backend_and_layout():
    assert ab.resolve("auto", "structure", backend="cpu") == "tiled"
    assert ab.resolve("auto", "causal", backend="cpu") == "tiled"
    assert ab.resolve("auto", "cache", backend="cpu") == "tiled"
    assert ab.resolve("auto", "mask", backend="cpu") == "dense"
    assert ab.resolve("auto", "causal", backend="gpu", dtype=jnp.bfloat16) == "cudnn"
    assert ab.resolve("auto", "causal", backend="gpu", dtype=jnp.float32) == "pallas"
    assert ab.resolve("auto", "structure", backend="gpu", dtype=jnp.bfloat16) == "pallas"
    assert ab.resolve("auto", "structure", backend="tpu") == "splash"
    assert ab.resolve("auto", "cache", backend="tpu") == "tiled"
    assert ab.resolve("auto", "cache", backend="gpu", dtype=jnp.bfloat16) == "pallas"
    assert ab.resolve("splash", "structure", backend="tpu") == "splash"
    assert ab.resolve("cudnn", "causal", backend="cuda", dtype=jnp.bfloat16) == "cudnn"
    assert jax.default_backend() == "cpu"
    with pytest.raises(ab.AttentionUnavailable, match="splash.*TPU.*'cpu' backend"):
        ab.resolve("splash", "structure")
    with pytest.raises(ab.AttentionUnavailable, match="cudnn.*GPU.*'cpu' backend"):
        ab.resolve("cudnn", "causal")
    with pytest.raises(ab.AttentionUnavailable, match="plain causal / segment-causal"):
        ab.resolve("cudnn", "structure", backend="gpu")
    with pytest.raises(ab.AttentionUnavailable, match="explicit dense mask"):
        ab.resolve("tiled", "mask")
    with pytest.raises(ConfigError, match="dense, tiled, splash, cudnn, pallas, auto"):
        ab.resolve("flash", "causal")


@pytest.mark.parametrize("impl,needs", [("splash", "TPU"), ("cudnn", "GPU")])
def test_model_fails_clearly_for_unavailable_backend(impl, needs):
    params = model_lib.init_params(TINY, jax.random.key(0))
    arr = arranged_batch("dual")
    m = model_lib.Transformer(TINY, attention=impl)
    with pytest.raises(ab.AttentionUnavailable, match=f"{impl}.*{needs}.*'cpu' backend"):
        m.apply({"params": params}, arr["tokens"][:, :24], arr["positions"][:, :24])


def test_cudnn_call_through_xla_equals_dense():
    """The cuDNN path's call (causal + document mask, padding rows zeroed) with XLA doing the
    computation, since cuDNN itself needs a GPU: packed rows with padding, GQA."""
    seg = jnp.asarray([[1] * 7 + [2] * 13 + [0] * 4, [0] * 3 + [1] * 21], jnp.int32)
    q, k, v, _ = qkv(8, 2, 24, 24, 4, 2, 8)
    out = ab.cudnn_attention(q, k, v, seg, 0.3, implementation="xla")
    assert_close(out, attention.attend(q, k, v, attention.segment_mask(seg, 2, 24), 0.3))
    plain = ab.cudnn_attention(q, k, v, None, 0.3, implementation="xla")
    assert_close(plain, attention.attend(q, k, v, attention.segment_mask(None, 2, 24), 0.3))


# ------------------------------------------------------------------- splash (interpreted)

@settings(max_examples=12, **SETTINGS)
@given(data=st.data(), layout=st.sampled_from(["dual", "plain", "ar", "causal"]),
       length=st.sampled_from([8, 24]), block_size=st.sampled_from([2, 4]))
def test_splash_template_check_is_exact(data, layout, length, block_size):
    """When `template_matches` says yes, the static template AND same-segment is exactly the
    structure's mask (what splash computes); block-aligned packings always match."""
    if layout == "dual":
        aligned = data.draw(st.booleans())
        if aligned:
            docs = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
            seg = np.concatenate([np.full(n * block_size, i + 1) for i, n in enumerate(docs)])
            seg = np.pad(seg, (0, 24 - len(seg)))[None].repeat(2, 0).astype(np.int32)
        else:
            seg = data.draw(packed_rows(2, length))
    else:
        aligned, seg = True, data.draw(packed_rows(2, length))
    s = structure_of(layout, seg, block_size)
    template = "dual" if layout == "dual" else "causal"
    ok = bool(ab.template_matches(s, template, block_size))
    if aligned:
        assert ok
    if ok:
        t = s["segment"].shape[1]
        tm = ab.splash_template(template, t, block_size)
        segs = np.asarray(s["segment"])
        same = (segs[:, :, None] == segs[:, None, :]) & (segs != 0)[:, :, None]
        np.testing.assert_array_equal(tm[None] & same, masking.structure_mask(s))


def test_splash_kernel_interpreted_equals_dense():
    """The splash path run by Pallas in interpret mode on CPU, block-aligned packing (the kernel
    itself), forward and dq, dk, dv; and a non-aligned packing (the exact tiled fallback), forward."""
    q, k, v, w = qkv(6, 2, 128, 128, 4, 2, 16)
    for seg, grad in (([[1] * 32 + [2] * 16 + [0] * 16, [1] * 64], True),
                      ([[1] * 25 + [2] * 30 + [0] * 9, [0] * 3 + [1] * 61], False)):
        s = ta.dual_stream_structure(np.asarray(seg, np.int32), 16)
        assert bool(ab.template_matches(s, "dual", 16)) == grad
        fn = lambda q, k, v: ab.splash_attention(q, k, v, s, 0.25, layout="dual", block_size=16,
                                                 tile=32, interpret=True)
        ref_fn = lambda q, k, v: attention.attend(q, k, v, masking.structure_mask(s), 0.25)
        if grad:
            out, vjp = jax.vjp(fn, q, k, v)
            ref, vjp_ref = jax.vjp(ref_fn, q, k, v)
            for got, want in zip(vjp(w), vjp_ref(w)):   # dq, dk, dv
                assert_close(got, want)
        else:
            out, ref = fn(q, k, v), ref_fn(q, k, v)
        assert_close(out, ref)


# ------------------------------------------------------------------- full train step

def test_full_train_step_tiled_equals_dense(tmp_path):
    """One jitted train step of the training program (train/step.py: on-device dual-stream
    arrangement, loss, grad, clip, AdamW) with attention=tiled equals the step with dense.
    optimizer.eps=1e-3 keeps AdamW's first update g / (|g| + eps) Lipschitz in g (with the
    default 1e-8 a gradient entry of ~1e-9 turns rounding noise into a +-lr step)."""
    from tests.synthetic import train_data as fixtures
    from train import step as step_lib
    from train.config import load_config, model_config
    from wedlm_jax.sharding import make_mesh

    path = fixtures.write_config(str(tmp_path / "cfg.yaml"), fixtures.tiny_config_dict(
        {"train": str(tmp_path / "unused.jsonl"), "tokenizer": str(tmp_path)}))
    b, n = 8, 32
    seg = np.ones((b, n), np.int32)
    seg[1, 20:], seg[2, 25:], seg[3, :5], seg[4, 9:] = 2, 0, 0, 3
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    out = {}
    for impl in ("tiled", "dense"):
        cfg = load_config(path, [f"attention={impl}", "attention_tile=16", "remat=true",
                                 "optimizer.eps=1e-3"])
        mc = model_config(cfg)
        opt = step_lib.make_optimizer(cfg)
        sh = step_lib.state_shardings(mc, opt, mesh)
        state = step_lib.init_state(model_lib.init_params(mc, jax.random.key(0)), opt, sh)
        fn = step_lib.make_train_step(cfg, mc, opt, mesh, sh, mc.vocab_size - 1)
        tokens = np.random.default_rng(0).integers(0, mc.vocab_size - 1, (b, n))
        batch = {"tokens": jnp.asarray(tokens, jnp.int32), "segment_ids": jnp.asarray(seg),
                 "maskable": jnp.asarray(seg != 0), "index": jnp.arange(b, dtype=jnp.int32)}
        state, metrics = fn(state, batch)
        out[impl] = jax.device_get((state["params"], metrics))
    (pt, mt), (pd, md) = out["tiled"], out["dense"]
    assert md["masked_count"] > 0 and md["loss"] > 0
    for key in ("loss", "mlm_loss", "ar_loss", "grad_norm"):
        assert_close(mt[key], md[key])
    rel = jax.tree.map(lambda a, r: float(np.max(np.abs(a - r)) / np.max(np.abs(r))), pt, pd)
    assert max(jax.tree.leaves(rel)) <= 1e-5, rel


# ----------------------------------------------------------------- sharded (8 host devices)

def _sharded_worker():
    """On a ('data', 'fsdp', 'tensor') = (2, 2, 2) mesh of 8 host devices, batch and heads
    sharded: splash (interpret mode, under jax.shard_map; rows 0-2 block-aligned -> the kernel,
    row 3 not -> the tiled fallback), the GPU flash kernels (interpret mode, under jax.shard_map)
    and tiled, all equal to dense."""
    from wedlm_jax.attention import flash as fa
    from jax.sharding import NamedSharding, PartitionSpec as P
    from wedlm_jax.sharding import make_mesh
    assert jax.device_count() == 8
    mesh = make_mesh(2, 2, 2)
    b, n = 4, 64
    seg = np.ones((b, n), np.int32)
    seg[1, 32:], seg[2, 48:], seg[3, 20:] = 2, 0, 2
    s = ta.dual_stream_structure(seg, 16)
    q, k, v, _ = qkv(7, b, 2 * n, 2 * n, 4, 2, 16)
    spec = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
    q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
    ref = attention.attend(q, k, v, masking.structure_mask(s), 0.25)
    with jax.set_mesh(mesh):
        splash = jax.jit(lambda q, k, v, s: ab.splash_attention(
            q, k, v, s, 0.25, layout="dual", block_size=16, tile=32, interpret=True))(q, k, v, s)
        tiled = jax.jit(lambda q, k, v, s: ta.tiled_attention(q, k, v, s, s, 0.25, tile_q=32,
                                                              tile_k=32))(q, k, v, s)
        flash = jax.jit(lambda q, k, v, s: fa.flash_attention(q, k, v, s, s, 0.25, tile=32,
                                                              interpret=True))(q, k, v, s)
    matches = [bool(ab.template_matches({key: a[i:i + 1] for key, a in s.items()}, "dual", 16))
               for i in range(b)]
    assert matches == [True, True, True, False], matches
    assert_close(splash, ref)
    assert_close(tiled, ref)
    assert_close(flash, ref)
    print("SHARDED_OK", splash.sharding.spec)


def test_splash_flash_and_tiled_sharded_on_8_devices():
    from tests import xla
    env = dict(os.environ, XLA_FLAGS=xla.flags(8),
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests.test_tiled_attention"], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SHARDED_OK" in proc.stdout


if __name__ == "__main__":
    _sharded_worker()
