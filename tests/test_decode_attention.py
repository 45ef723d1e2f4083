"""Cache-mode attention that follows the work (issue 4 item 5): `kv_tile` reads only the cache tiles
up to the longest live length in the batch (online softmax, dynamic trip count). Checked against
the dense cache-mode path of the same model, and by poisoning every row past the live tiles with
NaN: a read of any of them would turn the output into NaN."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wedlm_jax import attention
from wedlm_jax.config import ModelConfig
from wedlm_jax.model import Transformer, init_kv_cache, param_shapes

CONFIG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, s: (0.05 * rng.standard_normal(s.shape)
                         + (1.0 if "scale" in jax.tree_util.keystr(path) else 0.0)).astype(np.float32),
        param_shapes(CONFIG))


@functools.partial(jax.jit, static_argnums=5)
def forward(params, toks, pos, cache, lens, tile=None):
    """Cache-mode forward: dense over the whole capacity (tile None) or tiled."""
    return Transformer(CONFIG).apply({"params": params}, toks, pos, kv_cache=cache, cache_len=lens,
                                     kv_tile=tile)


def _filled_cache(params, lens, capacity):
    """A cache whose rows 0..lens[b]-1 hold K/V of random tokens (via the dense path)."""
    b, pre = len(lens), max(lens)
    toks = np.random.default_rng(1).integers(0, 64, (b, pre))
    pos = np.broadcast_to(np.arange(pre), (b, pre))
    _, cache = forward(params, toks, pos, init_kv_cache(CONFIG, b, capacity), jnp.zeros((b,), jnp.int32))
    return cache


@pytest.mark.parametrize("tile", [7, 200])
def test_tiled_equals_dense(tile):
    params = _params()
    lens = jnp.array([0, 17, 40, 5], jnp.int32)
    cache = _filled_cache(params, [0, 17, 40, 5], 96)
    toks = np.random.default_rng(2).integers(0, 64, (4, 6))
    pos = np.asarray(lens)[:, None] + np.array([3, 0, 1, 5, 2, 4])[None]   # reordered logical positions
    dense, dcache = forward(params, toks, pos, cache, lens)
    tiled, tcache = forward(params, toks, pos, cache, lens, tile)
    assert np.abs(np.asarray(dense)).max() > 1e-2
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(dense), atol=1e-5)
    for a, b in zip(jax.tree.leaves(dcache), jax.tree.leaves(tcache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_rows_past_the_live_tiles_are_never_read():
    params = _params(3)
    lens = jnp.array([9, 30], jnp.int32)
    s, tile, capacity = 4, 8, 128
    cache = _filled_cache(params, [9, 30], capacity)
    live = -(-(30 + s) // tile) * tile                  # rows the tiled path may read: 0..39
    poisoned = jax.tree.map(lambda x: x.at[:, :, live:].set(jnp.nan), cache)  # [layers, B, rows, ...]
    toks = np.random.default_rng(4).integers(0, 64, (2, s))
    pos = np.asarray(lens)[:, None] + np.arange(s)[None]
    tiled, _ = forward(params, toks, pos, poisoned, lens, tile)
    dense, _ = forward(params, toks, pos, cache, lens)
    assert np.isfinite(np.asarray(tiled)).all()
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(dense), atol=1e-5)
    # the dense path reads the whole capacity: the same poison reaches its output
    dense_poisoned, _ = forward(params, toks, pos, poisoned, lens)
    assert np.isnan(np.asarray(dense_poisoned)).any()


def test_attend_cache_tiles_matches_attend_directly():
    rng = np.random.default_rng(5)
    b, s, h, kvh, d, t = 3, 5, 4, 2, 8, 50
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    k = rng.standard_normal((b, t, kvh, d)).astype(np.float32)
    v = rng.standard_normal((b, t, kvh, d)).astype(np.float32)
    lens = jnp.array([0, 20, 45], jnp.int32)                 # 45 + 5 = 50: the last tile is pulled back
    mask = attention.cache_mask(lens, s, t)
    want = attention.attend(q, k, v, mask, 0.3)
    tiles = jax.jit(attention.attend_cache_tiles, static_argnums=(4, 5))
    for tile in (3, 16, 64):
        got = tiles(q, k, v, lens, 0.3, tile)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, err_msg=str(tile))
    with pytest.raises(ValueError, match="kv_tile must be >= 1, got 0"):
        attention.attend_cache_tiles(q, k, v, lens, 0.3, 0)
