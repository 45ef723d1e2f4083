"""The model's three attention entry points, dtype policy, remat and sharding."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wedlm_jax.config import ModelConfig
from wedlm_jax.model import Transformer, init_kv_cache, init_params
from tests import xla

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


_jit_apply = jax.jit(Transformer(CFG).apply)


def _apply(params, *args, **kw):
    return _jit_apply({"params": params}, *args, **kw)


def test_cache_mode_equals_full_forward(params):
    """Chunked prefill of a different prefix length per row, then S new slots on top of the cache
    (in a permuted physical order, as a reordered window is), equals one full forward."""
    rng = np.random.default_rng(0)
    batch, total, capacity, s_new = 3, 20, 32, 5
    tokens = rng.integers(0, 64, (batch, total))
    prefix = np.array([3, 9, 14])
    full = np.asarray(_apply(params, tokens, np.broadcast_to(np.arange(total), (batch, total))))

    cache = init_kv_cache(CFG, batch, capacity)
    apply = lambda p, t, pos, c, n: _apply(p, t, pos, kv_cache=c, cache_len=n)
    # Prefill in chunks of 8 (rows shorter than a chunk write junk past their length, which the
    # new slots overwrite and the mask never reads).
    n = np.zeros(batch, np.int32)
    for start in range(0, prefix.max(), 8):
        chunk = np.arange(start, start + 8)
        take = np.minimum(chunk[None], total - 1).repeat(batch, 0)
        _, cache = apply(params, np.take_along_axis(tokens, take, 1), take, cache, n)
        n = np.minimum(n + 8, prefix).astype(np.int32)
    assert (n == prefix).all()

    perm = rng.permutation(s_new)
    idx = prefix[:, None] + perm[None]
    logits, cache = apply(params, np.take_along_axis(tokens, idx, 1), idx, cache, n)
    # Physical slot i of the window sees the cache and window slots 0..i: compare with a full
    # forward of [prefix ; reordered window] per row.
    for b in range(batch):
        order = np.concatenate([np.arange(prefix[b]), idx[b]])
        ref = np.asarray(_apply(params, tokens[b:b + 1, order], order[None]))[0, prefix[b]:]
        np.testing.assert_allclose(np.asarray(logits[b]), ref, atol=1e-5)
    # In natural order the window's logits are the full forward's.
    idx = prefix[:, None] + np.arange(s_new)[None]
    logits, _ = apply(params, np.take_along_axis(tokens, idx, 1), idx, cache, n)
    np.testing.assert_allclose(np.asarray(logits), np.take_along_axis(full, idx[..., None], 1), atol=1e-5)


def test_cache_rows_written_at_cache_len(params):
    cache = init_kv_cache(CFG, 2, 16)
    n = np.array([2, 5], np.int32)
    _, new = _apply(params, np.ones((2, 3), np.int32), n[:, None] + np.arange(3), kv_cache=cache, cache_len=n)
    k = np.asarray(new["k"][0])
    for b in range(2):
        written = np.abs(k[b]).sum(axis=(1, 2)) > 0
        assert written.tolist() == [n[b] <= r < n[b] + 3 for r in range(16)]


def test_packed_segments_equal_separate_documents(params):
    rng = np.random.default_rng(1)
    lengths = [5, 7, 3]
    docs = [rng.integers(0, 64, ln) for ln in lengths]
    tokens = np.concatenate(docs + [np.zeros(2, np.int64)])[None]
    seg = np.concatenate([np.full(ln, i + 1) for i, ln in enumerate(lengths)] + [np.zeros(2)])[None]
    pos = np.concatenate([np.arange(ln) for ln in lengths] + [np.zeros(2)])[None].astype(np.int32)
    packed = np.asarray(_apply(params, tokens, pos, segment_ids=seg.astype(np.int32)))
    start = 0
    for d in docs:
        alone = np.asarray(_apply(params, d[None], np.arange(len(d))[None]))
        np.testing.assert_allclose(packed[:, start:start + len(d)], alone, atol=1e-5)
        start += len(d)
    assert np.isfinite(packed).all()


def test_explicit_mask_matches_structure(params):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 64, (2, 8))
    pos = np.broadcast_to(np.arange(8), (2, 8))
    causal = np.tril(np.ones((8, 8), bool))
    a = _apply(params, tokens, pos)
    b = _apply(params, tokens, pos, mask=np.broadcast_to(causal, (2, 8, 8)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    # A mask that hides key 0 from query 5 changes query 5 and nothing before it.
    m = causal.copy()
    m[5, 0] = False
    c = np.asarray(_apply(params, tokens, pos, mask=m))
    np.testing.assert_allclose(c[:, :5], np.asarray(a)[:, :5], atol=1e-6)
    assert np.abs(c[:, 5] - np.asarray(a)[:, 5]).max() > 1e-4
    # A query with no allowed key (padding) gives finite logits.
    m[3] = False
    assert np.isfinite(np.asarray(_apply(params, tokens, pos, mask=m))).all()


def test_dtype_policy_and_remat(params):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 64, (2, 8))
    pos = np.broadcast_to(np.arange(8), (2, 8))
    f32 = Transformer(CFG).apply({"params": params}, tokens, pos)
    bf16 = Transformer(CFG, dtype=jnp.bfloat16).apply({"params": params}, tokens, pos)
    assert f32.dtype == jnp.float32 and bf16.dtype == jnp.float32
    assert float(jnp.abs(bf16 - f32).max()) < 0.05
    bf16_params = init_params(CFG, jax.random.key(0), param_dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16_params))

    def loss(p, remat):
        out = Transformer(CFG, remat=remat).apply({"params": p}, tokens, pos)
        return jnp.mean(jax.nn.logsumexp(out, -1))
    g0 = jax.jit(jax.grad(loss), static_argnums=1)(params, False)
    g1 = jax.jit(jax.grad(loss), static_argnums=1)(params, True)  # the old switch: full remat
    for x, y in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
    from wedlm_jax.model import remat_policy  # every policy vs a looped model: test_scanned_equals_looped
    assert [remat_policy(p) for p in (True, False, "save_dots")] == ["full", "none", "save_dots"]
    with pytest.raises(ValueError, match="remat policy 'dots'.*allowed: full, save_dots, none"):
        Transformer(CFG, remat="dots").apply({"params": params}, tokens, pos)


SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from wedlm_jax.config import ModelConfig
    from wedlm_jax.model import Transformer, init_params, param_logical_axes, param_shapes
    from wedlm_jax import sharding
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (4, 16)).astype(np.int32)
    pos = np.stack([rng.permutation(16) for _ in range(4)]).astype(np.int32)
    model = Transformer(cfg)
    ref = np.asarray(jax.jit(model.apply)({"params": params}, tokens, pos))
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    shard = sharding.tree_shardings(param_logical_axes(cfg), param_shapes(cfg), mesh)
    sp = jax.device_put(params, shard)
    # Sharded over something: the q projection splits heads over 'tensor', embed over 'fsdp'.
    # (the leading 'layers' axis of the stacked kernel is never split)
    assert sp["layers"]["attn"]["q_proj"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None), \\
        sp["layers"]["attn"]["q_proj"]["kernel"].sharding.spec
    batch = jax.sharding.NamedSharding(mesh, sharding.spec_for(("batch", "length"), tokens.shape, mesh))
    with jax.set_mesh(mesh):
        import flax.linen as nn
        with nn.logical_axis_rules(sharding.DEFAULT_RULES.as_flax_rules()):
            out = jax.jit(model.apply)({"params": sp}, jax.device_put(tokens, batch), jax.device_put(pos, batch))
    assert len(out.sharding.device_set) == 8
    print("MAXDIFF", float(np.abs(np.asarray(out) - ref).max()))
""")


def test_sharded_logits_equal_unsharded():
    env = dict(os.environ, XLA_FLAGS=xla.flags(8))
    res = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert res.returncode == 0, res.stderr[-3000:]
    diff = float(res.stdout.split("MAXDIFF")[1])
    assert diff <= 1e-5


def test_scanned_equals_looped(params):
    """The layer scan (with each remat policy) equals a Python loop over the layers
    (tests/looped_model): logits and gradients of a loss, and cache-mode logits and cache, 1e-5."""
    from tests.looped_model import looped_apply
    config = CFG
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 64, (2, 9)).astype(np.int32)
    pos = np.stack([rng.permutation(9) for _ in range(2)]).astype(np.int32)
    seg = np.array([[1] * 5 + [2] * 4, [1] * 9], np.int32)
    loss = lambda logits: jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 3])

    def both(forward):  # logits and gradients of one forward
        return jax.jit(lambda p: (forward(p), jax.grad(lambda q: loss(forward(q)))(p)))(params)

    ref_logits, ref_grads = both(lambda p: looped_apply(config, p, tokens, pos, segment_ids=seg))
    for policy in ("none", "full", "save_dots"):
        model = Transformer(config, remat=policy)
        logits, grads = both(lambda p: model.apply({"params": p}, tokens, pos, segment_ids=seg))
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)
        assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
        for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
            assert float(jnp.abs(r).max()) > 0, jax.tree_util.keystr(path)
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5,
                                       err_msg=f"{policy} {jax.tree_util.keystr(path)}")
    cache = init_kv_cache(config, 2, 16)
    n = np.array([0, 4], np.int32)
    cpos = n[:, None] + np.arange(9)
    got, got_cache = jax.jit(Transformer(config).apply)({"params": params}, tokens, cpos,
                                                        kv_cache=cache, cache_len=n)
    ref, ref_cache = jax.jit(lambda p: looped_apply(config, p, tokens, cpos, kv_cache=cache,
                                                    cache_len=n))(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
    for key in ("k", "v"):
        assert got_cache[key].shape == (config.num_layers, 2, 16, config.num_kv_heads, config.head_dim)
        np.testing.assert_allclose(np.asarray(got_cache[key]), np.asarray(ref_cache[key]), atol=1e-5)


def test_one_tree_per_layer_equals_the_stack(params):
    """`Transformer(stacked_layers=False)` over `unstack_layers(params)` (GPU decoding's weights:
    decode/engine/planning/layouts.py) equals the layer scan over the stacked params, full forward and cache
    mode; `unstack_layers` takes arrays, shapes and logical axes alike and its tree is the one
    the unstacked model's init makes."""
    from tests.looped_model import looped_apply
    from wedlm_jax import model as model_lib
    per_layer = model_lib.unstack_layers(params, CFG.num_layers)
    flat = Transformer(CFG, stacked_layers=False)
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2]], jnp.int32)
    pos = jnp.arange(7, dtype=jnp.int32)[None]
    init = jax.eval_shape(lambda: flat.init(jax.random.key(0), tokens, pos))["params"]
    assert jax.tree.structure(nn_unbox(init)) == jax.tree.structure(per_layer)
    assert not model_lib.layers_stacked(per_layer) and model_lib.layers_stacked(params)
    np.testing.assert_allclose(np.asarray(flat.apply({"params": per_layer}, tokens, pos)),
                               np.asarray(_apply(params, tokens, pos)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(flat.apply({"params": per_layer}, tokens, pos)),
                               np.asarray(looped_apply(CFG, params, tokens, pos)), atol=1e-5)
    cache, n = init_kv_cache(CFG, 1, 16), jnp.asarray([4], jnp.int32)
    got, got_cache = flat.apply({"params": per_layer}, tokens, n[:, None] + pos, kv_cache=cache,
                                cache_len=n)
    ref, ref_cache = _apply(params, tokens, n[:, None] + pos, kv_cache=cache, cache_len=n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_cache["k"]), np.asarray(ref_cache["k"]), atol=1e-5)
    shapes = model_lib.unstack_layers(model_lib.param_shapes(CFG), CFG.num_layers)
    assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, per_layer)
    axes = model_lib.unstack_layers(model_lib.param_logical_axes(CFG), CFG.num_layers)
    assert axes["layer_1"]["mlp"]["gate_proj"]["kernel"] == ("embed", "mlp")
    assert set(axes) == set(per_layer)


def nn_unbox(tree):
    import flax.linen as nn
    return nn.meta.unbox(tree)


def test_kv_cache_constructor_and_axes(params):
    from wedlm_jax.model import kv_cache_logical_axes
    cache = init_kv_cache(CFG, 3, 8, jnp.bfloat16)
    axes = kv_cache_logical_axes(CFG)
    assert jax.tree.structure(cache) == jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple))
    for key in ("k", "v"):
        assert cache[key].shape == (2, 3, 8, 2, 16) and cache[key].dtype == jnp.bfloat16
        assert len(axes[key]) == cache[key].ndim and axes[key][0] == "layers"
    with pytest.raises(ValueError, match=r"kv_cache\['k'\] has shape \(3, 3, 8, 2, 16\)"):
        Transformer(CFG).apply({"params": params}, np.ones((3, 2), np.int32), np.zeros((3, 2), np.int32),
                               kv_cache=init_kv_cache(CFG.replace(num_layers=3), 3, 8),
                               cache_len=np.zeros(3, np.int32))
