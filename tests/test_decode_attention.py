"""Cache-mode attention (wedlm_jax.attention.cache): every implementation equals the dense
reference on CPU (the accelerator kernels in their CPU-checkable form: Pallas interpret mode,
the cuDNN argument set through implementation='xla'), directly and through the model; the live-tile
paths never read a row past their tiles (poisoned with NaN); bad choices fail naming what runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import plans

from wedlm_jax.attention import backends as ab, cache as ca, core as attention
from wedlm_jax.config import ModelConfig
from wedlm_jax.model import Transformer, init_kv_cache, param_shapes

CONFIG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
KERNELS = ("tiled", "pallas", "cudnn")


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, s: (0.05 * rng.standard_normal(s.shape)
                         + (1.0 if "scale" in jax.tree_util.keystr(path) else 0.0)).astype(np.float32),
        param_shapes(CONFIG))


@functools.partial(jax.jit, static_argnums=(5, 6))
def forward(params, toks, pos, cache, lens, impl="dense", tile=256):
    model = Transformer(CONFIG, attention=impl, kv_tile=tile, attention_interpret=True)
    return model.apply({"params": params}, toks, pos, kv_cache=cache, cache_len=lens)


def _filled_cache(params, lens, capacity):
    """A cache whose rows 0..lens[b]-1 hold K/V of random tokens (via the dense path)."""
    b, pre = len(lens), max(lens)
    toks = np.random.default_rng(1).integers(0, 64, (b, pre))
    pos = np.broadcast_to(np.arange(pre), (b, pre))
    _, cache = forward(params, toks, pos, init_kv_cache(CONFIG, b, capacity), jnp.zeros((b,), jnp.int32))
    return cache


# ---------------------------------------------------------------------------- the kernels

# (batch, new slots S, query heads, KV heads, capacity T, cache lengths): GQA ratios 1, 3, 4;
# ragged lengths, an empty row, and rows whose last tile is pulled back (n + S == T).
CASES = [(3, 1, 4, 4, 40, [0, 17, 39]),
         (3, 5, 6, 2, 50, [0, 20, 45]),
         (2, 8, 4, 1, 33, [25, 3])]


@functools.partial(jax.jit, static_argnums=0)
def kernel(impl, q, k, v, lens):
    return ca.attend_cache(impl, q, k, v, lens, 0.3, tile=7, interpret=True)


@functools.partial(jax.jit, static_argnums=(0, 1))
def reference(s, t, q, k, v, lens):
    return attention.attend(q, k, v, attention.cache_mask(lens, s, t), 0.3)


@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_equals_dense(impl):
    rng = np.random.default_rng(5)
    for b, s, h, kvh, t, lens in CASES:
        q = rng.standard_normal((b, s, h, 8)).astype(np.float32)
        k = rng.standard_normal((b, t, kvh, 8)).astype(np.float32)
        v = rng.standard_normal((b, t, kvh, 8)).astype(np.float32)
        lens = jnp.asarray(lens, jnp.int32)
        want, got = reference(s, t, q, k, v, lens), kernel(impl, q, k, v, lens)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6,
                                   err_msg=f"{impl} S={s} H={h}/{kvh} T={t}")


def test_cudnn_argument_set_is_the_cache_rule():
    """What the cuDNN call receives: key lengths cache_len + S (clipped to T) and the mask."""
    lens = jnp.asarray([0, 6, 9], jnp.int32)
    args = ca.cudnn_arguments(lens, 3, 12)
    np.testing.assert_array_equal(args["key_value_seq_lengths"], [3, 9, 12])
    np.testing.assert_array_equal(args["query_seq_lengths"], [3, 3, 3])
    np.testing.assert_array_equal(args["mask"][:, 0], attention.cache_mask(lens, 3, 12))
    assert bool(args["mask"][1, 0, 2, 8]) and not bool(args["mask"][1, 0, 1, 8])


def test_pallas_lowers_for_the_gpu():
    """The Pallas kernel lowers through Triton for CUDA (cross-lowered here; the compiled kernel
    runs only on a GPU), bf16, a Qwen3-8B-like head layout, capacity not a power of two."""
    q = jax.ShapeDtypeStruct((2, 16, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = jax.jit(lambda q, k, v, n: ca.attend_cache_pallas(q, k, v, n, 0.1, 128))
    text = fn.trace(q, kv, kv, lens).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "wedlm_cache_attention" in text


# ----------------------------------------------------------------------------- the model

def test_model_cache_forward_is_the_same_on_every_backend():
    params = _params()
    lens = jnp.array([0, 17, 40, 5], jnp.int32)
    cache = _filled_cache(params, [0, 17, 40, 5], 96)
    toks = np.random.default_rng(2).integers(0, 64, (4, 6))
    pos = np.asarray(lens)[:, None] + np.array([3, 0, 1, 5, 2, 4])[None]   # reordered logical positions
    dense, dcache = forward(params, toks, pos, cache, lens)
    assert np.abs(np.asarray(dense)).max() > 1e-2
    for impl, tile in [("tiled", 7), ("tiled", 200), ("pallas", 16), ("cudnn", 256), ("auto", 8)]:
        got, gcache = forward(params, toks, pos, cache, lens, impl, tile)
        np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=1e-5, err_msg=impl)
        for a, b in zip(jax.tree.leaves(dcache), jax.tree.leaves(gcache)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=impl)


def test_rows_past_the_live_tiles_are_never_read():
    """tiled reads the tiles up to the longest row of the batch; pallas only each row's own."""
    params = _params(3)
    lens = jnp.array([9, 30], jnp.int32)
    s, tile, capacity = 4, 8, 128
    cache = _filled_cache(params, [9, 30], capacity)
    toks = np.random.default_rng(4).integers(0, 64, (2, s))
    pos = np.asarray(lens)[:, None] + np.arange(s)[None]
    dense, _ = forward(params, toks, pos, cache, lens)
    live_batch = -(-(30 + s) // tile) * tile                      # rows 0..39 for every row
    live_row = [-(-(9 + s) // tile) * tile, live_batch]           # 16 for row 0, 40 for row 1

    def poison(rows_per_row):
        return jax.tree.map(lambda x: jnp.stack([x[:, b].at[:, r:].set(jnp.nan)   # [layers, B, rows, ..]
                                                 for b, r in enumerate(rows_per_row)], axis=1), cache)

    for impl, live in [("tiled", [live_batch] * 2), ("pallas", live_row)]:
        got, _ = forward(params, toks, pos, poison(live), lens, impl, tile)
        assert np.isfinite(np.asarray(got)).all(), impl
        np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=1e-5, err_msg=impl)
    # the dense path reads the whole capacity: the same poison reaches its output
    dense_poisoned, _ = forward(params, toks, pos, poison([live_batch] * 2), lens)
    assert np.isnan(np.asarray(dense_poisoned)).any()


# ---------------------------------------------------------------------------- bad input

def test_missing_backends_are_named_with_the_available_ones():
    assert jax.default_backend() == "cpu"
    assert ab.available("cache") == ["dense", "tiled"]
    assert ab.available("cache", backend="gpu", dtype=jnp.bfloat16) == ["dense", "tiled", "cudnn",
                                                                         "pallas"]
    assert ab.available("cache", interpret=True) == ["dense", "tiled", "cudnn", "pallas"]
    assert ab.resolve("pallas", "cache", backend="gpu") == "pallas"
    assert ab.resolve("cudnn", "cache", backend="gpu", dtype=jnp.bfloat16) == "cudnn"
    with pytest.raises(ab.AttentionUnavailable,
                       match=r"'pallas'.*GPU.*'cpu' backend, where 'cache' attention can use: "
                             r"dense, tiled$"):
        ab.resolve("pallas", "cache")
    with pytest.raises(ab.AttentionUnavailable, match=r"'cudnn'.*GPU.*can use: dense, tiled$"):
        ab.resolve("cudnn", "cache", dtype=jnp.bfloat16)
    with pytest.raises(ab.AttentionUnavailable,
                       match=r"'splash' handles training layouts.*'tpu' can use: dense, tiled"):
        ab.resolve("splash", "cache", backend="tpu")
    assert ab.resolve("pallas", "structure", backend="gpu") == "pallas"    # the flash kernels
    with pytest.raises(ab.AttentionUnavailable, match=r"'pallas' needs a structure"):
        ab.resolve("pallas", "mask", backend="gpu")
    with pytest.raises(ab.AttentionUnavailable, match=r"bf16/fp16.*float32.*dense, tiled, pallas"):
        ab.resolve("cudnn", "cache", backend="gpu", dtype=jnp.float32)
    params = _params()
    model = Transformer(CONFIG, attention="pallas")
    with pytest.raises(ab.AttentionUnavailable, match="can use: dense, tiled"):
        model.apply({"params": params}, np.zeros((1, 2), np.int32), np.zeros((1, 2), np.int32),
                    kv_cache=init_kv_cache(CONFIG, 1, 8), cache_len=jnp.zeros((1,), jnp.int32))


def test_bad_tile_and_shapes_are_refused():
    params = _params()
    cache = init_kv_cache(CONFIG, 1, 8)
    toks = np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="kv_tile must be an int >= 1, got 0"):
        Transformer(CONFIG, kv_tile=0).apply(                  # checked whatever the backend
            {"params": params}, toks, toks, kv_cache=cache, cache_len=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="9 new slots do not fit a cache of 8 rows"):
        Transformer(CONFIG).apply({"params": params}, np.zeros((1, 9), np.int32),
                                  np.zeros((1, 9), np.int32), kv_cache=cache,
                                  cache_len=jnp.zeros((1,), jnp.int32))
    with pytest.raises(TypeError, match="kv_tile"):   # a model setting, not a call argument
        Transformer(CONFIG).apply({"params": params}, toks, toks, kv_cache=cache,
                                  cache_len=jnp.zeros((1,), jnp.int32), kv_tile=4)


def test_pallas_tile_fits_the_devices_shared_memory():
    """The Triton kernel's KV tile is chosen from the device's shared memory: the 8B shape's
    streaming step (W 16, refill before: 32 slots x 4 query heads per KV head = 128 rows, two
    programs of 64, head_dim 128, bf16) asks 278,528 bytes at tile 256, over an H100's 232,448;
    tile 128 fits."""
    h100, a100, ada = (ca.smem_limit(type("D", (), {"compute_capability": cc})())
                       for cc in ("9.0", "8.0", "8.9"))
    assert (h100, a100, ada) == (232448, 166912, 101376)
    assert ca.pallas_smem(256, 128, 128, 2) == 278528 > h100
    assert ca.pallas_smem(256, 4096, 128, 2) == ca.pallas_smem(256, 64, 128, 2)  # blocks of 64 rows
    assert ca.pallas_smem(256, 8, 128, 2) == 2 * 2 * 256 * 128 * 2 + 16 * 128 * 2   # padded to 16
    assert ca.pallas_tile(256, 128, 128, 2, h100) == 128
    assert ca.pallas_tile(256, 128, 128, 2, a100) == 128
    assert ca.pallas_tile(256, 128, 128, 2, ada) == 64
    assert ca.pallas_tile(256, 8, 128, 2, h100) == 128            # K/V tiles alone: 256 KiB
    assert ca.pallas_tile(256, 8, 64, 2, h100) == 256             # head_dim 64 keeps 256
    assert ca.smem_limit(None) == min(ca.SMEM_BYTES.values())     # unknown: the smallest
    with pytest.raises(ValueError, match="even at a 16-row KV tile"):
        ca.pallas_tile(256, 4096, 256, 4, ada)


def test_decoder_picks_the_pallas_tile_for_its_device():
    c = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=64,
                    num_layers=1, num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=True,
                    max_position_embeddings=8192, mask_token_id=63)
    params = param_shapes(c, jnp.bfloat16)
    kw = dict(method="streaming", window=16, refill="before", slots=1, capacity=4096,
              memory_limit_bytes=1 << 62, sampling=False, dtype=jnp.bfloat16, kv_tile=256,
              attention="pallas")
    # CPU: no compute capability, so the smallest budget (101,376 B); a 512-row prefill chunk x 4
    # query heads is cut into programs of 64 query rows, as the window's 32 slots x 4 are
    for chunk in (512, 16):
        dec = plans.decoder(params, c, prefill_chunk=chunk, **kw)
        assert dec.static.kv_tile == ca.pallas_tile(256, 128, 128, 2, ca.smem_limit(None)) == 64
    kw["dtype"] = jnp.float32   # 4-byte items: 64 query rows and two stages of 16-row tiles fit no
    with pytest.raises(Exception, match="shared memory"):   # longer once head_dim is 512
        plans.decoder(param_shapes(c.replace(head_dim=512), jnp.float32),
                      c.replace(head_dim=512), **kw)


def test_auto_splits_fill_a_small_grid():
    """A grid under TARGET_PROGRAMS programs gets its tiles cut into splits (powers of two, each
    keeping a tile at full capacity); a full grid gets none."""
    assert ca.auto_splits(8 * 8, 20) == 4            # the 8B shape, 8 slots: 64 programs -> 256
    assert ca.auto_splits(1 * 8, 20) == 16           # one slot: capped by the 20 tiles of a row
    assert ca.auto_splits(1 * 8, 1) == 1
    assert ca.auto_splits(32 * 8, 20) == 1           # 256 programs already
    assert ca.auto_splits(3, 1000) * 3 >= ca.TARGET_PROGRAMS > ca.auto_splits(3, 1000) * 3 // 2
    assert [ca.query_rows(r) for r in (1, 4, 16, 17, 64, 120, 512)] == [16, 16, 16, 32, 64, 64, 64]


def test_pallas_query_blocks_match_the_reference():
    """A prefill chunk's S x G query rows are cut into blocks of QUERY_BLOCK rows, one program
    each, every block reading its rows' live tiles only (the block's last query's): the dense
    reference's output, with and without splits, ragged cache lengths."""
    rng = np.random.default_rng(9)
    b, s, h, kvh, t = 2, 40, 6, 2, 120              # 40 x 3 = 120 rows -> 2 blocks of 64
    q = rng.standard_normal((b, s, h, 8)).astype(np.float32)
    k = rng.standard_normal((b, t, kvh, 8)).astype(np.float32)
    v = rng.standard_normal((b, t, kvh, 8)).astype(np.float32)
    lens = jnp.asarray([0, 70], jnp.int32)
    want = reference(s, t, q, k, v, lens)
    for splits in (None, 1, 4):
        got = ca.attend_cache_pallas(q, k, v, lens, 0.3, 16, interpret=True, splits=splits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, err_msg=str(splits))


def test_pallas_reads_its_layer_of_the_stacked_cache_in_place():
    """With a static layer the kernel takes the stacked cache [L, B, T, KVH, D] whole (its blocks
    index the layer; no copy of the layer's slice before the call): the same output as the
    kernel on the slice, and the Triton call's operand is the stacked buffer."""
    rng = np.random.default_rng(8)
    b, s, h, kvh, t, layers = 3, 5, 6, 2, 50, 3
    q = rng.standard_normal((b, s, h, 8)).astype(np.float32)
    k = rng.standard_normal((layers, b, t, kvh, 8)).astype(np.float32)
    v = rng.standard_normal((layers, b, t, kvh, 8)).astype(np.float32)
    lens = jnp.asarray([0, 20, 45], jnp.int32)
    for layer in range(layers):
        want = reference(s, t, q, k[layer], v[layer], lens)
        got = ca.attend_cache("pallas", q, k, v, lens, 0.3, tile=7, interpret=True, layer=layer)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, err_msg=str(layer))
    with pytest.raises(ValueError, match="layer must be a Python int"):
        ca.attend_cache_pallas(q, k, v, lens, 0.3, 8, interpret=True, layer=layers)
    # the live tiles split over programs (3 parts, and more parts than tiles: empty splits)
    want = reference(s, t, q, k[1], v[1], lens)
    for splits in (3, 16):
        got = ca.attend_cache_pallas(q, k, v, lens, 0.3, 7, interpret=True, layer=1, splits=splits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, err_msg=str(splits))
    with pytest.raises(ValueError, match="splits must be an int >= 1"):
        ca.attend_cache_pallas(q, k, v, lens, 0.3, 8, interpret=True, layer=1, splits=0)
    qs = jax.ShapeDtypeStruct((2, 16, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 2, 300, 8, 128), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((2,), jnp.int32)
    for layer, stacked in ((2, True), (jnp.int32(2), False)):   # a traced layer takes the slice
        fn = jax.jit(lambda q, k, v, n, layer=layer: ca.attend_cache("pallas", q, k, v, n, 0.1,
                                                                     tile=128, layer=layer))
        text = fn.trace(qs, kv, kv, n).lower(lowering_platforms=("cuda",)).as_text()
        call = next(line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line)
        assert ("tensor<4x2x300x8x128xbf16>" in call) == stacked, call[-300:]
    fn = jax.jit(lambda q, k, v, n: ca.attend_cache_pallas(q, k, v, n, 0.1, 128, layer=2, splits=4))
    assert "__gpu$xla.gpu.triton" in fn.trace(qs, kv, kv, n).lower(lowering_platforms=("cuda",)).as_text()


def test_unrolled_layers_read_the_cache_in_place_through_the_kernel():
    """The model with one parameter tree per layer (how the Decoder runs on GPU) passes each
    layer's index as a Python int: the Pallas path (stacked cache in place) equals dense."""
    from wedlm_jax.model import unstack_layers
    params = _params(6)
    lens = jnp.array([3, 30], jnp.int32)
    cache = _filled_cache(params, [3, 30], 64)
    toks = np.random.default_rng(7).integers(0, 64, (2, 4))
    pos = np.asarray(lens)[:, None] + np.array([2, 0, 3, 1])[None]
    want, wcache = forward(params, toks, pos, cache, lens)
    model = Transformer(CONFIG, attention="pallas", kv_tile=8, attention_interpret=True,
                        stacked_layers=False)
    got, gcache = jax.jit(lambda p, c: model.apply({"params": p}, toks, pos, kv_cache=c,
                                                   cache_len=lens))(
        unstack_layers(params, CONFIG.num_layers), cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    for a, b in zip(jax.tree.leaves(wcache), jax.tree.leaves(gcache)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
