"""Flash attention for the training structures (wedlm_jax.attention.flash: the Triton kernels run
by Pallas in interpret mode on CPU) against the dense masked reference `attention.attend`: values
and gradients over random packings, paddings, block sizes and layouts; the model's entry; the
resolver's choice on GPU. (Sharded under jax.shard_map: tests/test_tiled_attention.py's 8-device
worker; compiled for an H100 by XLA's GPU compiler: tests/test_gpu_compile.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.attention_cases import (SETTINGS, TINY, arranged_batch, assert_close, packed_rows,
                                   qkv, structure_of)
from wedlm_jax import masking
from wedlm_jax import model as model_lib
from wedlm_jax.attention import backends as ab, core as attention
from wedlm_jax.attention import flash as fa


@functools.partial(jax.jit, static_argnames=("scale", "tile"))
def dense_and_flash(q, k, v, w, qs, ks, scale, tile):
    """(out, dq, dk, dv) of the dense reference and of the flash kernels, loss sum(out * w)."""
    def both(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out,) + vjp(w)
    mask = masking.pair_mask(qs, ks)
    dense = both(lambda q, k, v: attention.attend(q, k, v, mask, scale))
    flash = both(lambda q, k, v: fa.flash_attention(q, k, v, qs, ks, scale, tile=tile,
                                                    interpret=True))
    return dense, flash


@settings(max_examples=10, **SETTINGS)
@given(data=st.data(), layout=st.sampled_from(["dual", "plain", "ar", "causal"]),
       block_size=st.integers(1, 8))
def test_forward_and_gradients_equal_dense(data, layout, block_size):
    """Rows of 20 tokens (40 slots dual-stream: padded to 4 tiles of 16, 20 otherwise: 2 tiles);
    packings, paddings and block sizes are runtime data, one compilation per shape. GQA: 4 query
    heads on 2 KV heads."""
    seg = data.draw(packed_rows(2, 20))
    s = structure_of(layout, seg, block_size)
    t = s["segment"].shape[1]
    q, k, v, w = qkv(data.draw(st.integers(0, 99)), 2, t, t, 4, 2, 16)
    ref, got = dense_and_flash(q, k, v, w, s, s, scale=0.3, tile=16)
    for a, e in zip(got, ref):
        assert_close(a, e)


def test_queries_and_keys_with_their_own_structures():
    """A query window over longer keys (query i of row b at index cache_len[b] + i), 3 query heads
    on 1 KV head: the plan walks a different structure on each side."""
    lens, new, t = np.array([5, 30]), 6, 48
    index = lens[:, None] + np.arange(new)[None]
    zeros = np.zeros((2, new), np.int32)
    qs = {"segment": np.ones((2, new), np.int32), "stream": zeros, "block": zeros,
          "index": index.astype(np.int32)}
    kidx = np.broadcast_to(np.arange(t), (2, t))
    ks = {"segment": (kidx < lens[:, None] + new).astype(np.int32) * 1,
          "stream": np.zeros((2, t), np.int32), "block": np.zeros((2, t), np.int32),
          "index": kidx.astype(np.int32)}
    q, k, v, w = qkv(3, 2, new, t, 3, 1, 32)
    ref, got = dense_and_flash(q, k, v, w, qs, ks, scale=0.2, tile=16)
    for a, e in zip(got, ref):
        assert_close(a, e)


def test_padding_rows_output_zero_and_bf16_close_to_dense():
    """A row of padding only and a half-padded row: zero output, zero gradient there; in bf16 the
    kernels stay within bf16 rounding of the float32 reference."""
    seg = np.array([[0] * 16, [1] * 8 + [0] * 8], np.int32)
    s = structure_of("dual", seg, 4)
    q, k, v, w = qkv(5, 2, 32, 32, 2, 2, 16)
    _, (out, dq, dk, dv) = dense_and_flash(q, k, v, w, s, s, scale=0.25, tile=16)
    pad = np.asarray(s["segment"]) == 0
    assert np.all(np.asarray(out)[pad] == 0) and np.all(np.asarray(dq)[pad] == 0)
    assert np.all(np.asarray(dk)[pad] == 0) and np.all(np.asarray(dv)[pad] == 0)
    bf = lambda x: x.astype(jnp.bfloat16)
    half = fa.flash_attention(bf(q), bf(k), bf(v), s, s, 0.25, tile=16, interpret=True)
    assert half.dtype == jnp.bfloat16
    ref = attention.attend(q, k, v, masking.structure_mask(s), 0.25)
    np.testing.assert_allclose(np.asarray(half, np.float32), ref, atol=3e-2)


def test_plan_skips_what_the_rule_forbids():
    """The dual stream of 128 tokens, block 16, tiles of 16: the kernels walk only the non-empty
    tile pairs, about a quarter of all; lengths are padded to a power-of-two number of tiles."""
    s = structure_of("dual", np.ones((1, 128), np.int32), 16)
    qs, ks, plan = fa.flash_plan(s, s, 16)
    assert qs["segment"].shape == (1, 256) and plan.tile_q == plan.tile_k == 16
    walked = int(np.sum(plan.kv_count))
    assert walked == int(np.sum(np.asarray(plan.state) != 0))
    assert 0.2 < walked / plan.state.size < 0.3
    qs, _, plan = fa.flash_plan(structure_of("causal", np.ones((1, 40), np.int32), 1), s, 128)
    assert qs["segment"].shape == (1, 64) and plan.tile_q == fa.TILE


def test_model_structure_and_packed_entries_equal_dense():
    """The model with attention='pallas' (interpret mode) on a dual-stream arrangement and on
    packed causal rows gives the dense model's logits."""
    config = TINY.replace(hidden_size=64, head_dim=16)
    params = model_lib.init_params(config, jax.random.key(0))
    arr = arranged_batch("dual")
    run = lambda impl, **kw: model_lib.Transformer(config, attention=impl, attention_tile=16,
                                                   attention_interpret=True).apply(
        {"params": params}, arr["tokens"], arr["positions"], **kw)
    structure = {key: arr[key] for key in masking.STRUCTURE_KEYS}
    assert_close(run("pallas", structure=structure), run("dense", structure=structure), 1e-4)
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 20 + [0] * 8], arr["tokens"].shape[0], 0))
    tokens, pos = arr["tokens"], arr["positions"]
    packed = lambda impl: model_lib.Transformer(config, attention=impl, attention_tile=16,
                                                attention_interpret=True).apply(
        {"params": params}, tokens, pos, segment_ids=seg)
    assert_close(packed("pallas"), packed("dense"), 1e-4)


def test_resolver_picks_the_kernels_for_training_structures_on_gpu():
    """auto on GPU: the kernels for every training structure; asked for off GPU: a clear refusal;
    a head_dim that is not a power of two (24) runs padded."""
    assert ab.resolve("auto", "structure", backend="gpu", dtype=jnp.bfloat16) == "pallas"
    assert ab.resolve("auto", "structure", backend="gpu", dtype=jnp.float32) == "pallas"
    assert ab.resolve("pallas", "causal", backend="gpu") == "pallas"
    with pytest.raises(ab.AttentionUnavailable, match="pallas.*GPU.*'cpu' backend"):
        ab.resolve("pallas", "structure")
    q, k, v, w = qkv(0, 2, 24, 24, 4, 2, 24)     # head_dim 24: padded to 32 inside
    s = structure_of("plain", np.array([[1] * 24, [1] * 10 + [0] * 14], np.int32), 4)
    ref, got = dense_and_flash(q, k, v, w, s, s, scale=0.2, tile=16)
    for a, e in zip(got, ref):
        assert_close(a, e)
