"""The paged KV cache's pieces: the host page pool with prefix reuse (decode/engine/runtime/pages.py),
checked by brute force against a shadow of what every page holds, and the device side
(wedlm_jax/attention/paged.py) against the dense cache and against jax's own reference of the TPU
ragged paged attention kernel."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.engine.runtime.pages import PagePool, PoolError, ShardedPool
from wedlm_jax.attention import paged as pa
from wedlm_jax.attention.core import cache_write
from wedlm_jax.attention.cache import attend_cache_dense


# ----------------------------------------------------------------------------------- the pool

def _run_workload(seed: int, requests: int, num_pages: int = 48, page: int = 4):
    """Random requests over a few shared prefixes: each matches its cached prefix, allocates the
    rest of its prompt and some generated rows, publishes its prompt, grows, and ends or is
    cancelled (in random order, several alive at once). A shadow records the tokens written to
    every page; a match must return pages whose shadow equals the prompt's pages. check() after
    every operation."""
    rng = random.Random(seed)
    pool = PagePool(num_pages, page)
    shadow: dict = {}                       # page -> the tokens its rows hold
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live, done, hits, refused = [], 0, 0, 0
    while done < requests:
        if live and (rng.random() < 0.45 or len(live) > 6):
            seq = live.pop(rng.randrange(len(live)))
            pool.release(seq["pages"])
            pool.check()
            done += 1
            continue
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        limit = (len(prompt) - 1) // page
        hit = pool.match(prompt, limit)
        for i, p in enumerate(hit):        # what a hit maps is what the prompt would have written
            assert shadow[p] == prompt[i * page:(i + 1) * page]
        hits += len(hit)
        total = pool.pages_for(len(prompt) + rng.randrange(0, 9))
        more = pool.allocate(total - len(hit))
        if more is None:                    # the pool is full: the request waits (dropped here)
            pool.release(hit)
            pool.check()
            refused += 1
            if not live:
                done += 1
            continue
        pages = hit + more
        for i, p in enumerate(more, start=len(hit)):   # prefill writes the prompt's rows
            shadow[p] = prompt[i * page:(i + 1) * page]
        pool.publish(prompt, pages)
        pool.check()
        live.append({"pages": pages})
    for seq in live:
        pool.release(seq["pages"])
    pool.check()
    return pool, hits, refused


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pool_brute_force_no_leak_after_1000_requests(seed):
    pool, hits, _ = _run_workload(seed, 1000)
    assert pool.num_held == 0 and pool.num_free == pool.num_pages   # every page free or cached
    assert hits > 200                                                # shared prefixes were reused
    assert pool.stats.hit_pages == hits


def test_pool_allocate_refuses_whole_and_evicts_least_recent_first():
    pool = PagePool(4, 2)
    a = pool.allocate(2)
    pool.publish([1, 2, 3, 4], a)
    pool.release(a)                         # both cached now (a[0] older? released together)
    b = pool.allocate(2)
    pool.publish([9, 9, 8, 8], b)
    pool.release(b)
    assert pool.num_cached == 4 and pool.allocate(5) is None
    pool.check()
    assert pool.match([1, 2, 3, 4, 5]) == a                  # touched: now the most recent
    pool.release(a)
    got = pool.allocate(2)                   # evicts b's pages (least recently used)
    assert sorted(got) == sorted(b) and pool.stats.evictions == 2
    assert pool.match([9, 9, 8, 8, 7]) == []
    assert pool.match([1, 2, 3, 4, 7]) == a
    with pytest.raises(PoolError, match="is not held"):
        pool.release([got[0], got[0], got[0]])


def test_pool_same_content_twice_stays_one_shared_copy():
    pool = PagePool(8, 2)
    x, y = pool.allocate(2), pool.allocate(2)
    assert pool.publish([5, 6, 7, 8], x) == 2
    assert pool.publish([5, 6, 7, 8], y) == 0          # computed twice at once: x is the shared one
    pool.release(y)
    assert pool.num_cached == 0 and pool.match([5, 6, 7, 8, 1]) == x
    pool.check()


def test_sharded_pool_keeps_each_shards_pages_and_prefixes_apart():
    """Slots over data x fsdp: shard d's pages are ids d * per_shard .., its prefix cache its own;
    ids go back to the shard that gave them; one sequence cannot hold pages of two shards."""
    pool = ShardedPool(12, 2, shards=3)
    assert pool.per_shard == 4 and pool.num_pages == 12
    a = pool.allocate(1, 3)
    assert a == [4, 5, 6] and pool.free_in(1) == 1 and pool.free_in(0) == 4
    pool.publish([1, 2, 3, 4, 5], a)
    assert pool.cached(1, [1, 2, 3, 4, 9]) == 2 and pool.cached(0, [1, 2, 3, 4, 9]) == 0
    assert pool.match(0, [1, 2, 3, 4, 9]) == [] and pool.match(1, [1, 2, 3, 4, 9], 1) == [4]
    assert pool.stats.lookups == 2 and pool.stats.hit_pages == 1
    assert pool.allocate(1, 2) is None                 # shard 1 is short; the others are not
    assert pool.allocate(2, 4) == [8, 9, 10, 11]
    pool.release([4])
    pool.release(a)
    pool.release([8, 9, 10, 11])
    pool.check()
    assert pool.num_held == 0 and pool.num_free == 12 and pool.num_cached == 2
    b = pool.allocate(0, 1) + pool.allocate(2, 1)
    with pytest.raises(PoolError, match="span shards"):
        pool.publish([1, 2, 3, 4], b)
    with pytest.raises(PoolError, match="not in the pool"):
        pool.release([12])
    with pytest.raises(PoolError, match="evenly over 5 shards"):
        ShardedPool(12, 2, shards=5)


def test_shard_page_ids_keep_only_the_shards_own_pages():
    table = jnp.asarray([[0, 3, 4, pa.UNMAPPED], [7, 6, 2, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(pa.shard_page_ids(table, 1, 4)),
                                  [[-1, -1, 0, -1], [3, 2, -1, 1]])
    np.testing.assert_array_equal(np.asarray(pa.shard_page_ids(table, 0, 4)),
                                  [[0, 3, -1, -1], [-1, -1, 2, -1]])


# ------------------------------------------------------------------------------- device side

def _random_case(seed, b=3, s=4, kvh=2, g=2, d=16, page=4, width=6, num_pages=24):
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((num_pages, page, 2 * kvh, d)).astype(np.float32)
    perm = rng.permutation(num_pages)
    table = np.full((b, width), pa.UNMAPPED, np.int32)
    lens = np.array([0, 9, page * width - s][:b], np.int32)
    for i in range(b):
        n = -(-(int(lens[i]) + s) // page)
        table[i, :n] = perm[i * width:i * width + n]
    q = rng.standard_normal((b, s, kvh * g, d)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(pool), jnp.asarray(table), jnp.asarray(lens)


def _dense(pool, table):
    """The dense cache [B, width * page, KVH, D] the page table describes (zeros where unmapped)."""
    k, v, mapped = pa.gather_rows(pool, table, 0, table.shape[1])
    return (jnp.where(mapped[..., None, None], k, 0.0), jnp.where(mapped[..., None, None], v, 0.0))


@pytest.mark.parametrize("pages_per_tile", [1, 2, 4, 6])
def test_gather_attention_equals_the_dense_cache(pages_per_tile):
    q, pool, table, lens = _random_case(0)
    k, v = _dense(pool, table)
    want = attend_cache_dense(q, k, v, lens, 0.25)
    got = pa.attend_pages("gather", q, pool, table, lens, 0.25, pages_per_tile=pages_per_tile)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_write_pages_equals_the_dense_cache_write_and_drops_unmapped_rows():
    q, pool, table, lens = _random_case(1)
    rng = np.random.default_rng(2)
    kn = jnp.asarray(rng.standard_normal((3, 4, 2, 16)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((3, 4, 2, 16)).astype(np.float32))
    k0, v0 = _dense(pool, table)
    new_pool = pa.write_pages(pool, kn, vn, table, lens)
    k1, v1 = _dense(new_pool, table)
    dense_write = lambda buf, new: cache_write(buf[None], new, lens, 0)[0]   # one layer
    np.testing.assert_array_equal(np.asarray(k1), np.asarray(dense_write(k0, kn)))
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(dense_write(v0, vn)))
    untouched = np.setdiff1d(np.arange(pool.shape[0]), np.asarray(table)[np.asarray(table) >= 0])
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched])
    # rows past a sequence's pages: dropped, nothing else changes
    short = jnp.asarray(np.where(np.arange(6)[None] < 1, np.asarray(table), pa.UNMAPPED).astype(np.int32))
    out = pa.write_pages(pool, kn, vn, short, jnp.asarray([2, 2, 2], jnp.int32))
    changed = np.flatnonzero(np.any(np.asarray(out) != np.asarray(pool), axis=(1, 2, 3)))
    assert set(changed) <= set(np.asarray(short)[:, 0])


def test_copy_pages_copies_every_layers_rows_and_skips_padding():
    """`copy_pages` (a prefix cached in another slot shard, one device here): page dst[i] of
    every layer becomes page src[i] of that layer; -1 entries copy nothing; the rest is kept."""
    layers, per_layer = 3, 5
    pool = jax.random.normal(jax.random.key(0), (layers * per_layer, 4, 2, 8))
    out = np.asarray(pa.copy_pages(pool, [1, 3, -1], [4, 0, -1], layers, heads=2, kv_heads=1))
    want = np.asarray(pool).copy()
    for layer in range(layers):
        base = layer * per_layer
        want[base + 4], want[base + 0] = want[base + 1], want[base + 3]
    np.testing.assert_array_equal(out, want)


def test_layout_is_the_tpu_kernels_own():
    """jax's reference of the TPU ragged paged attention kernel (plain JAX) reads our pool and
    table the way attend_pages does: same outputs."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
    q, pool, table, lens = _random_case(3)
    b, s, h, d = q.shape
    want = ref_ragged_paged_attention(q.reshape(b * s, h, d), pool, lens + s, jnp.maximum(table, 0),
                                      jnp.arange(b + 1, dtype=jnp.int32) * s,
                                      jnp.array([b], jnp.int32), sm_scale=0.25)
    got = pa.attend_pages("gather", q, pool, table, lens, 0.25)
    np.testing.assert_allclose(np.asarray(got).reshape(b * s, h, d), np.asarray(want), atol=1e-5)


def test_the_platforms_page_size():
    """No page size asked for: pages of 64 on TPU where the ragged kernel reads the heads; for a
    continuous-batching door pages of 64 on GPU (the Triton paged kernel) and of 16 on CPU; the
    dense cache (0) for a static batch off TPU and where the TPU kernel cannot tile the heads or
    read their head_dim (not a multiple of 128: the demo model's 64)."""
    auto = pa.auto_page_size
    assert auto("tpu", 32, 8, 128, jnp.bfloat16) == pa.TPU_PAGE_SIZE == 64
    assert auto("tpu", 32, 8, 128, jnp.bfloat16, tensor=8) == 64
    assert auto("cpu", 32, 8, 128, jnp.bfloat16) == 0
    assert auto("cpu", 32, 8, 128, jnp.bfloat16, continuous=True) == pa.CPU_CONTINUOUS_PAGE_SIZE == 16
    assert auto("gpu", 32, 8, 128, jnp.bfloat16, continuous=True) == pa.GPU_PAGE_SIZE == 64
    assert auto("cuda", 6, 3, 64, jnp.float32, continuous=True) == 64
    assert auto("tpu", 32, 8, 256, jnp.bfloat16, continuous=True) == 64
    assert auto("gpu", 32, 8, 128, jnp.bfloat16) == auto("cuda", 6, 3, 64, jnp.float32) == 0
    assert auto("tpu", 6, 3, 128, jnp.float32) == 0     # 6 interleaved rows: the kernel cannot tile
    assert auto("tpu", 6, 2, 64, jnp.bfloat16) == 0     # head_dim 64: the kernel cannot read it
    assert auto("tpu", 6, 2, 64, jnp.bfloat16, continuous=True) == 0
    with pytest.raises(ValueError, match="cannot tile 3 KV heads"):
        pa.check_ragged(6, 3, 128, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 128 values; this model's head_dim is 64"):
        pa.check_ragged(6, 2, 64, jnp.bfloat16)
    pa.check_ragged(6, 2, 128, jnp.bfloat16)


def test_the_gather_tile_is_a_whole_number_of_pages():
    """On GPU the gather loop takes at least GPU_GATHER_ROWS rows per iteration (each iteration a
    fixed cost there); elsewhere the Decoder's kv_tile, rounded down to whole pages."""
    assert pa.gather_tile("gpu", 256, 64) == pa.GPU_GATHER_ROWS == 1024
    assert pa.gather_tile("gpu", 2048, 64) == 2048
    assert pa.gather_tile("gpu", 256, 24) == 1008            # 42 pages of 24
    assert pa.gather_tile("cpu", 256, 64) == 256
    assert pa.gather_tile("tpu", 100, 64) == 64             # at least one page
    assert pa.gather_tile("cpu", 256, 48) == 240


def test_unknown_implementation_is_named():
    q, pool, table, lens = _random_case(0)
    with pytest.raises(ValueError, match="gather, ragged"):
        pa.attend_pages("flash", q, pool, table, lens, 0.25)
    assert jax.devices()   # the CPU backend is up


RAGGED_TPU = """
import json
import jax, jax.numpy as jnp
from jax.experimental import topologies
from wedlm_jax.attention import paged as pa
dev = topologies.get_topology_desc(platform="tpu", topology_name="v5p:1x1x1",
                                   chips_per_host_bounds=(1, 1, 1)).devices[0]
sh = jax.sharding.SingleDeviceSharding(dev)
B, S, H, KVH, D, WIDTH, P = 4, 16, 8, 2, 128, 16, 64
out = {}
for page in (64, 24, 200):
    args = [jax.ShapeDtypeStruct(s, t, sharding=sh) for s, t in (
        ((B, S, H, D), jnp.bfloat16), ((P, page, 2 * KVH, D), jnp.bfloat16),
        ((B, WIDTH), jnp.int32), ((B,), jnp.int32))]
    f = jax.jit(lambda q, pool, table, lens: pa.attend_pages("ragged", q, pool, table, lens, 0.088))
    with jax.default_device(dev):   # the Mosaic lowering reads the TPU generation from it
        out[page] = "tpu_custom_call" in f.lower(*args).compile().as_text()
print(json.dumps(out))
"""


def test_ragged_kernel_compiles_for_a_tpu_over_this_layout():
    """jax's TPU ragged paged attention kernel, called the way attend_pages('ragged') calls it on
    this pool layout, compiles for one v5p chip (libtpu, no TPU) into a Mosaic custom call, at
    the default page of 64 rows and at sizes that divide no tile (24, 200: the kernel puts no
    constraint on the page size; its constraint, the KV heads' tiling, is `check_ragged`, checked
    when a Decoder is built)."""
    import json
    import subprocess
    import sys
    from tests import tpu_compiler
    if not tpu_compiler.installed():
        pytest.fail(f"libtpu is missing from {tpu_compiler.folder()}: run `make setup`")
    proc = subprocess.run([sys.executable, "-c", RAGGED_TPU], env=tpu_compiler.env(),
                          capture_output=True, text=True, timeout=420, cwd=tpu_compiler.ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"64": True, "24": True, "200": True}


@pytest.mark.parametrize("case", [dict(seed=0), dict(seed=6, s=40, page=16, width=6, num_pages=40),
                                  dict(seed=7, s=1, g=4, page=16, width=5, num_pages=20)])
def test_triton_paged_kernel_equals_the_dense_cache(case):
    """The Triton paged kernel (Pallas interpret mode here) reads each sequence's pages through
    its table: the dense cache's result, with unmapped entries, an empty sequence, query blocks
    (40 slots x 2 query heads: two blocks of 64 rows) and one layer's pages at an offset."""
    q, pool, table, lens = _random_case(**case)
    k, v = _dense(pool, table)
    want = attend_cache_dense(q, k, v, lens, 0.25)
    got = pa.attend_pages("triton", q, pool, table, lens, 0.25, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    other = jnp.asarray(np.random.default_rng(9).standard_normal(pool.shape).astype(np.float32))
    stacked = jnp.concatenate([other, pool])                     # layer 1 = `pool`
    got = pa.attend_pages("triton", q, stacked, table, lens, 0.25, first_page=pool.shape[0],
                          interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    for splits in (2, 5):     # each sequence's pages split over programs, partials combined
        got = pa.attend_pages_triton(q, pool, table, lens, 0.25, interpret=True, splits=splits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_triton_paged_kernel_lowers_for_the_gpu():
    """Cross-lowered for CUDA (the compiled kernel runs only on a GPU): bf16, the 8B head layout,
    pages of 64, a window of 16 slots and a prefill chunk of 144 (query blocks), whole and split."""
    for s in (16, 144):
        q = jax.ShapeDtypeStruct((2, s, 32, 128), jnp.bfloat16)
        pool = jax.ShapeDtypeStruct((4 * 20, 64, 16, 128), jnp.bfloat16)
        table = jax.ShapeDtypeStruct((2, 10), jnp.int32)
        n = jax.ShapeDtypeStruct((2,), jnp.int32)
        for splits in (1, 4):
            fn = jax.jit(lambda q, p, t, n, splits=splits: pa.attend_pages_triton(
                q, p, t, n, 0.1, first_page=40, splits=splits))
            text = fn.trace(q, pool, table, n).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text and "wedlm_paged_attention" in text


def test_paged_attention_is_chosen_for_the_device():
    """Off TPU a paged cache takes the Triton kernel on GPU where it fits (asked for, or auto),
    the XLA gather path otherwise; asking for the kernel where it cannot run is an error naming
    why; TPU keeps its ragged kernel."""
    h100, ada = 232448, 101376
    choose = pa.choose_attention
    assert choose("auto", "gpu", 64, 128, 2, h100) == choose("pallas", "gpu", 64, 128, 2, h100) == "pallas"
    assert choose("tiled", "gpu", 64, 128, 2, h100) == "tiled"
    assert choose("auto", "gpu", 24, 128, 2, h100) == "tiled"            # not a power of two
    assert choose("auto", "gpu", 64, 256, 4, ada) == "tiled"             # does not fit
    assert choose("auto", "cpu", 64, 128, 2, h100) == "tiled"
    assert choose("tiled", "tpu", 64, 128, 2, h100) == "tiled"
    assert pa.implementation_for("tpu", "pallas") == "ragged"
    assert pa.implementation_for("gpu", "pallas") == "triton"
    assert pa.implementation_for("gpu", "tiled") == pa.implementation_for("cpu") == "gather"
    with pytest.raises(ValueError, match="needs a GPU"):
        choose("pallas", "cpu", 64, 128, 2, h100)
    with pytest.raises(ValueError, match="page_size 24"):
        choose("pallas", "gpu", 24, 128, 2, h100)


def test_first_page_reads_and_writes_one_layers_pages():
    """The stacked pool [L * P, ...]: layer l is the offset l * P, never a slice."""
    q, pool, table, lens = _random_case(4)
    p = pool.shape[0]
    other = jnp.asarray(np.random.default_rng(5).standard_normal(pool.shape).astype(np.float32))
    stacked = jnp.concatenate([other, pool])                     # layer 1 = `pool`
    np.testing.assert_allclose(
        np.asarray(pa.attend_pages("gather", q, stacked, table, lens, 0.25, first_page=p)),
        np.asarray(pa.attend_pages("gather", q, pool, table, lens, 0.25)), atol=1e-6)
    kn = jnp.ones((3, 4, 2, 16))
    out = pa.write_pages(stacked, kn, kn, table, lens, first_page=p)
    np.testing.assert_array_equal(np.asarray(out[:p]), np.asarray(other))
    np.testing.assert_array_equal(np.asarray(out[p:]), np.asarray(pa.write_pages(pool, kn, kn, table, lens)))


def test_model_cache_mode_paged_equals_dense():
    """The Transformer in cache mode over a paged cache (pages scattered over the pool) gives the
    logits of the dense cache, a prefill then two window-sized steps, rows of different lengths:
    through the XLA gather path and through the Triton paged kernel."""
    from tests.synthetic import random_params
    from wedlm_jax import model as model_lib
    from wedlm_jax.config import ModelConfig
    config = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    params = random_params(config, seed=1)
    model = model_lib.Transformer(config, attention="tiled", kv_tile=8)
    # the Triton paged kernel (interpret mode), layers unrolled as on GPU (a static first page)
    kernel = model_lib.Transformer(config, attention="pallas", attention_interpret=True,
                                   stacked_layers=False)
    flat = model_lib.unstack_layers(params, config.num_layers)
    b, cap, page = 2, 48, 4
    dense = model_lib.init_kv_cache(config, b, cap)
    paged = pa.init_paged_cache(config.num_layers, 40, page, config.num_kv_heads, config.head_dim, b,
                                cap // page)
    perm = np.random.default_rng(0).permutation(40)[:2 * (cap // page)].reshape(b, cap // page)
    paged["table"] = jnp.asarray(perm.astype(np.int32))
    rng = np.random.default_rng(1)
    n = jnp.zeros((b,), jnp.int32)
    for s in (11, 6, 6):
        toks = jnp.asarray(rng.integers(0, 64, (b, s)).astype(np.int32))
        pos = n[:, None] + jnp.arange(s)[None]
        ld, dense = model.apply({"params": params}, toks, pos, kv_cache=dense, cache_len=n)
        lk, _ = kernel.apply({"params": flat}, toks, pos, kv_cache=paged, cache_len=n)
        lp, paged = model.apply({"params": params}, toks, pos, kv_cache=paged, cache_len=n)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(ld), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(lk), np.asarray(ld), atol=2e-5, rtol=2e-5)
        n = n + jnp.asarray([s, s - 3])          # rows commit different amounts


def test_a_gpu_server_pages_its_cache_unless_the_cache_is_int8():
    """The plan's cache for an H100 (a stand-in device: platform and compute capability): a
    continuous-batching door takes pages of 64 read by the Triton paged kernel; a static batch
    the dense cache; an int8 KV cache the dense cache and the tiled XLA path (the paged kernels
    read float pages); pages asked for by name with int8 keep the gather path."""
    import types

    from decode.config import EngineOptions, Placement
    from decode.engine.planning.plan import StepSpec, cache_choice
    from wedlm_jax.config import ModelConfig
    config = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=256,
                         intermediate_size=512, num_layers=2, num_heads=8, num_kv_heads=2,
                         head_dim=128, qk_norm=True)
    h100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    engine = EngineOptions(method="streaming", window=16, slots=4, capacity=2048)
    spec = StepSpec(method="streaming", window=16, refill="after", sampling=False)

    def choice(continuous, **placement):
        c = cache_choice(config, Placement(dtype="bfloat16", **placement), spec, engine, 2112, 1,
                         h100, 1, continuous)
        return c["page_size"], c["attention"]
    assert choice(True) == (64, "pallas")
    assert choice(False) == (0, "auto")
    assert choice(True, kv_dtype="int8") == (0, "tiled")
    assert choice(True, kv_dtype="int8", page_size=64) == (64, "tiled")
