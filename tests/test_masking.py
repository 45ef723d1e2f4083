"""Arrangements and attention structure (wedlm_jax.masking) against brute-force constructions
written rule by rule from docs/algorithm.md §2 (tests/mask_rules.py), independently of the
vectorised code."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wedlm_jax import masking
from tests.mask_rules import brute_causal_doc_mask, brute_documents, brute_dual_mask
from wedlm_jax.config import ConfigError

MASK_ID = 99
ROW_LEN = 32  # hypothesis rows are padded / cut to one length so each function compiles once
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------- strategies

@st.composite
def rows(draw, max_docs=3, max_doc_len=13):
    """A packed row: documents (fresh ids) and padding runs in any order, a maskable pattern."""
    pieces = draw(st.lists(st.tuples(st.booleans(), st.integers(1, max_doc_len)),
                           min_size=1, max_size=max_docs + 1))
    seg, next_id = [], 1
    for is_pad, n in pieces:
        if is_pad:
            seg += [0] * n
        else:
            seg += [next_id] * n
            next_id += 1
    seg = (seg + [0] * ROW_LEN)[:ROW_LEN]
    n = len(seg)
    mode = draw(st.sampled_from(["all", "random", "none"]))
    if mode == "all":
        maskable = [s != 0 for s in seg]
    elif mode == "none":
        maskable = [False] * n
    else:
        bits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        maskable = [b and s != 0 for b, s in zip(bits, seg)]
    tokens = draw(st.lists(st.integers(0, MASK_ID - 1), min_size=n, max_size=n))
    return (np.array(tokens, np.int32), np.array(seg, np.int32), np.array(maskable, bool))


def np_tree(d):
    return {k: np.asarray(v) for k, v in d.items()}


@functools.lru_cache(maxsize=None)
def jitted(name, **static):
    fn = getattr(masking, name)
    return jax.jit(functools.partial(fn, **static) if static else fn)


@functools.lru_cache(maxsize=None)
def rows_fn(objective, **static):
    return jax.jit(lambda k, t, s, m: masking.arrange_rows(objective, k, t, s, m, **static))


def dual(key, tokens, seg, maskable, block_size, mask_per_block=True):
    return np_tree(jitted("arrange_dual_stream", block_size=block_size, mask_token_id=MASK_ID,
                          mask_per_block=mask_per_block)(key, tokens, seg, maskable))


def mask_of(arr):
    return np.asarray(jitted("structure_mask")({k: arr[k] for k in masking.STRUCTURE_KEYS}))


# ----------------------------------------------------------------------- dual_stream_mask

@pytest.mark.parametrize("length,block", [(n, b) for n in (1, 2, 3, 5, 8) for b in (1, 2, 3, 5)]
                         + [(13, 4), (33, 32), (40, 7)])
def test_dual_stream_mask_matches_brute_force(length, block):
    got = masking.dual_stream_mask(length, block)
    assert got.shape == (2 * length, 2 * length) and got.dtype == bool
    want = brute_dual_mask([1] * length, block, np.arange(2 * length) - length)
    np.testing.assert_array_equal(got, want)


def test_dual_stream_mask_small_by_hand():
    # L = 4, B = 2: memory 0..3, prediction 4..7 (blocks {4,5}, {6,7}).
    want = np.array([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(masking.dual_stream_mask(4, 2), want)


def test_dual_stream_mask_is_about_a_quarter_dense():
    density = masking.dual_stream_mask(256, 32).mean()
    assert 0.22 < density < 0.28


# ------------------------------------------------------------------------ dual arrangement

def check_dual_arrangement(arr, tokens, seg, maskable, block_size, mask_per_block, eps=1e-3):
    n = len(tokens)
    docs, pos = brute_documents(list(seg))
    src = arr["source"]
    # memory stream is the clean row
    np.testing.assert_array_equal(src[:n], np.arange(n))
    np.testing.assert_array_equal(arr["tokens"][:n], tokens)
    np.testing.assert_array_equal(arr["positions"][:n], pos)
    assert not arr["is_masked"][:n].any() and not arr["mlm_weight"][:n].any()
    np.testing.assert_array_equal(arr["stream"], [0] * n + [1] * n)
    np.testing.assert_array_equal(arr["index"], np.arange(2 * n))
    # prediction stream: per block (contiguous range of the row), a permutation of the block
    pred_src = src[n:]
    blocks = {}
    for i in range(n):
        key = (docs[i] if docs[i] is not None else ("pad", i - pos[i]), pos[i] // block_size)
        blocks.setdefault(key, []).append(i)
    doc_ratios = {}
    for (doc, _), members in blocks.items():
        lo, hi = members[0], members[-1] + 1
        assert members == list(range(lo, hi))
        slot_src = list(pred_src[lo:hi])
        assert sorted(slot_src) == members
        masked = [bool(arr["is_masked"][n + j]) for j in range(lo, hi)]
        n_obs = masked.count(False)
        assert masked == [False] * n_obs + [True] * (hi - lo - n_obs), "observed first"
        assert slot_src[:n_obs] == sorted(slot_src[:n_obs])
        assert slot_src[n_obs:] == sorted(slot_src[n_obs:])
        ratio = arr["ratio"][n + lo:n + hi]
        assert (ratio == ratio[0]).all()
        g = np.float32(ratio[0])
        assert eps <= g <= 1.0
        n_maskable = int(sum(maskable[i] for i in members))
        assert hi - lo - n_obs == int(np.round(g * np.float32(n_maskable)))
        if doc is not None and not isinstance(doc, tuple):
            doc_ratios.setdefault(doc, set()).add(float(g))
        for j, s in zip(range(lo, hi), slot_src):
            slot = n + j
            m = bool(arr["is_masked"][slot])
            assert not m or maskable[s], "non-maskable token masked"
            assert arr["positions"][slot] == pos[s]
            assert arr["targets"][slot] == tokens[s]
            assert arr["tokens"][slot] == (MASK_ID if m else tokens[s])
            assert arr["segment"][slot] == arr["segment"][s]
            assert arr["block"][slot] == pos[s] // block_size
            np.testing.assert_allclose(arr["mlm_weight"][slot], 1.0 / g if m else 0.0, rtol=1e-6)
    if not mask_per_block:
        assert all(len(v) == 1 for v in doc_ratios.values()), "one ratio per document"
    # AR targets on the memory stream: next token of the same document, if trained
    for i in range(n):
        ok = (i + 1 < n and docs[i] is not None and docs[i + 1] == docs[i]
              and bool(maskable[i + 1]))
        assert arr["ar_weight"][i] == (1.0 if ok else 0.0)
        assert arr["ar_targets"][i] == (tokens[i + 1] if ok else 0)
    assert not arr["ar_weight"][n:].any()
    # segment numbering: 0 exactly on padding, equal within a document, distinct across
    seg_out = arr["segment"][:n]
    np.testing.assert_array_equal(seg_out == 0, seg == 0)
    for i in range(n):
        for j in range(n):
            if docs[i] is not None and docs[j] is not None:
                assert (seg_out[i] == seg_out[j]) == (docs[i] == docs[j])


@SETTINGS
@given(row=rows(), options=st.sampled_from([(1, True), (3, False), (4, True)]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_dual_arrangement_mask_and_invariants(row, options, seed):
    # a few (block size, mask_per_block) options only: each compiles once; dual_stream_mask is
    # checked against the brute force for many more block sizes above
    block_size, mask_per_block = options
    tokens, seg, maskable = row
    arr = dual(jax.random.key(seed), tokens, seg, maskable, block_size, mask_per_block)
    check_dual_arrangement(arr, tokens, seg, maskable, block_size, mask_per_block)
    got = mask_of(arr)
    np.testing.assert_array_equal(got, brute_dual_mask(seg, block_size, arr["source"]))
    # padding is never a target and attends nowhere
    pad = arr["segment"] == 0
    assert not arr["mlm_weight"][pad].any() and not arr["ar_weight"][pad].any()
    assert not got[pad].any() and not got[:, pad].any()
    # the structure does not depend on the draw
    struct = np_tree(jitted("dual_stream_structure", block_size=block_size)(seg))
    for k in masking.STRUCTURE_KEYS:
        np.testing.assert_array_equal(struct[k], arr[k])


def test_prompt_tokens_are_never_masked_nor_targets():
    seg = np.array([1] * 20 + [2] * 12, np.int32)
    maskable = np.array([False] * 8 + [True] * 12 + [False] * 12)  # doc 1: prompt 8; doc 2: prompt
    tokens = np.arange(32, dtype=np.int32)
    for seed in range(5):
        arr = dual(jax.random.key(seed), tokens, seg, maskable, block_size=4)
        masked_src = arr["source"][arr["is_masked"]]
        assert maskable[masked_src].all()
        # every AR target is a response token of doc 1
        np.testing.assert_array_equal(np.nonzero(arr["ar_weight"])[0], np.arange(7, 19))


def test_same_key_same_arrangement_and_rows_differ():
    n = 32
    tokens = np.arange(n, dtype=np.int32)
    seg = np.ones(n, np.int32)
    maskable = np.ones(n, bool)
    keys = masking.row_keys(7, 3, jnp.arange(4))
    a = dual(keys[0], tokens, seg, maskable, block_size=4)
    b = dual(keys[0], tokens, seg, maskable, block_size=4)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    masks = [dual(k, tokens, seg, maskable, block_size=4)["is_masked"] for k in keys]
    for i in range(4):
        for j in range(i + 1, 4):
            assert (masks[i] != masks[j]).any()


def test_row_keys_depend_on_seed_step_and_index():
    def data(k):
        return np.asarray(jax.random.key_data(k))
    base = data(masking.row_keys(0, 5, jnp.array([0, 1, 2])))
    np.testing.assert_array_equal(base, data(masking.row_keys(0, 5, jnp.array([0, 1, 2]))))
    assert len({tuple(r) for r in base}) == 3
    # a row's key depends only on its global index, not on which rows share the batch
    np.testing.assert_array_equal(base[2], data(masking.row_keys(0, 5, jnp.array([2])))[0])
    assert (base != data(masking.row_keys(0, 6, jnp.array([0, 1, 2])))).any(axis=1).all()
    assert (base != data(masking.row_keys(1, 5, jnp.array([0, 1, 2])))).any(axis=1).all()


def test_arrange_rows_under_jit_matches_single_rows():
    # (plain and ar go through arrange_rows in their property tests below)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MASK_ID, (3, 12)).astype(np.int32)
    seg = np.array([[1] * 12, [1] * 5 + [2] * 5 + [0] * 2, [3] * 7 + [0] * 5], np.int32)
    maskable = seg != 0
    keys = masking.row_keys(1, 2, jnp.arange(3))
    batched = rows_fn("dual", block_size=4, mask_token_id=MASK_ID)(keys, tokens, seg, maskable)
    assert masking.arranged_length("dual", 12) == 24
    for i in range(3):
        one = dual(keys[i], tokens[i], seg[i], maskable[i], block_size=4)
        for k, v in one.items():
            assert batched[k].shape == (3, 24)
            np.testing.assert_array_equal(np.asarray(batched[k][i]), v, err_msg=k)
    mask = np.asarray(masking.attention_mask(batched))
    assert mask.shape == (3, 24, 24)
    for i in range(3):
        np.testing.assert_array_equal(
            mask[i], brute_dual_mask(seg[i], 4, np.asarray(batched["source"][i])))


def test_masked_choice_is_uniform_and_ratio_uniform():
    # 500 rows of 8 blocks of 4 maskable tokens: within a block each position is equally likely
    # to be masked, and the ratio is U(0, 1] (clamped to eps).
    n_rows, block = 500, 4
    keys = masking.row_keys(0, 0, jnp.arange(n_rows))
    tokens = jnp.zeros((n_rows, 32), jnp.int32)
    seg = jnp.ones((n_rows, 32), jnp.int32)
    arr = np_tree(rows_fn("dual", block_size=block, mask_token_id=MASK_ID)(
        keys, tokens, seg, seg == 1))
    src = arr["source"][:, 32:]
    is_m = arr["is_masked"][:, 32:]
    masked_src = np.zeros((n_rows, 32))
    np.put_along_axis(masked_src, src, is_m.astype(float), axis=1)
    freq = masked_src.reshape(n_rows * 8, block).mean(axis=0)
    assert np.abs(freq - freq.mean()).max() < 0.035, freq
    g = arr["ratio"][:, 32::block].reshape(-1)
    assert abs(g.mean() - 0.5) < 0.03 and g.min() >= 1e-3 and g.max() <= 1.0
    assert len(np.unique(g)) > 0.99 * g.size, "one independent ratio per block"
    counts = is_m.reshape(n_rows * 8, block).sum(axis=1)
    np.testing.assert_array_equal(counts, np.round(g.astype(np.float32) * np.float32(block)))


# ------------------------------------------------------------------- plain and AR objectives

@SETTINGS
@given(row=rows(), seed=st.integers(0, 2 ** 31 - 1))
def test_plain_arrangement_mask_and_invariants(row, seed):
    tokens, seg, maskable = row
    n = len(tokens)
    arr = np_tree(rows_fn("plain", mask_token_id=MASK_ID)(
        jax.random.key(seed)[None], tokens[None], seg[None], maskable[None]))
    arr = {k: v[0] for k, v in arr.items()}
    docs, pos = brute_documents(list(seg))
    src = arr["source"]
    np.testing.assert_array_equal(mask_of(arr), brute_causal_doc_mask(seg, src))
    runs = {}
    for i in range(n):
        runs.setdefault(i - pos[i], []).append(i)
    for start, members in runs.items():
        lo, hi = members[0], members[-1] + 1
        slot_src = list(src[lo:hi])
        assert sorted(slot_src) == members
        masked = list(arr["is_masked"][lo:hi])
        n_obs = masked.count(False)
        assert masked == [False] * n_obs + [True] * (hi - lo - n_obs)
        assert slot_src[:n_obs] == sorted(slot_src[:n_obs])
        assert slot_src[n_obs:] == sorted(slot_src[n_obs:])
        g = np.float32(arr["ratio"][lo])
        assert (arr["ratio"][lo:hi] == g).all(), "one ratio per document"
        n_maskable = int(maskable[lo:hi].sum())
        assert hi - lo - n_obs == int(np.round(g * np.float32(n_maskable)))
        for j, s in zip(range(lo, hi), slot_src):
            m = bool(arr["is_masked"][j])
            assert not m or maskable[s]
            assert arr["positions"][j] == pos[s]
            assert arr["targets"][j] == tokens[s]
            assert arr["tokens"][j] == (MASK_ID if m else tokens[s])
            np.testing.assert_allclose(arr["mlm_weight"][j], 1.0 / g if m else 0.0, rtol=1e-6)
    assert not arr["ar_weight"].any()
    assert (arr["stream"] == 1).all() and (arr["block"] == 0).all()


@SETTINGS
@given(row=rows())
def test_ar_arrangement(row):
    tokens, seg, maskable = row
    n = len(tokens)
    arr = np_tree(rows_fn("ar")(
        None, tokens[None], seg[None], maskable[None]))
    arr = {k: v[0] for k, v in arr.items()}
    docs, pos = brute_documents(list(seg))
    np.testing.assert_array_equal(mask_of(arr), brute_causal_doc_mask(seg, np.arange(n)))
    np.testing.assert_array_equal(arr["tokens"], tokens)
    np.testing.assert_array_equal(arr["positions"], pos)
    assert not arr["is_masked"].any() and not arr["mlm_weight"].any()
    for i in range(n):
        ok = i + 1 < n and docs[i] is not None and docs[i + 1] == docs[i] and maskable[i + 1]
        assert arr["ar_weight"][i] == (1.0 if ok else 0.0)
        assert arr["ar_targets"][i] == (tokens[i + 1] if ok else 0)


# ------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"),
    (dict(block_size=-3), "block_size"),
    (dict(block_size=2.5), "block_size"),
    (dict(block_size=True), "block_size"),
    (dict(ar_weight=-0.5), "ar_weight"),
    (dict(ar_weight=float("nan")), "ar_weight"),
    (dict(eps=0.0), "eps"),
    (dict(eps=1.5), "eps"),
    (dict(objective="mlm"), "objective"),
    (dict(mask_token_id=None), "mask_token_id"),
    (dict(mask_token_id=-1), "mask_token_id"),
    (dict(mask_token_id=64, vocab_size=64), "mask_token_id"),
])
def test_validate_options_names_the_field(kwargs, field):
    base = dict(objective="dual", block_size=4, ar_weight=1.0, eps=1e-3, mask_token_id=5)
    base.update(kwargs)
    with pytest.raises(ConfigError, match=field):
        masking.validate_options(**base)


def test_validate_options_accepts_good_values():
    masking.validate_options(objective="dual", block_size=1, ar_weight=0.0, mask_token_id=0,
                             vocab_size=1)
    masking.validate_options(objective="ar", block_size=32, ar_weight=1.0, mask_token_id=None)


def test_bad_input_errors_before_compiling():
    row = (np.zeros(4, np.int32), np.ones(4, np.int32), np.ones(4, bool))
    with pytest.raises(ConfigError, match="block_size"):
        masking.arrange_dual_stream(jax.random.key(0), *row, block_size=0, mask_token_id=1)
    with pytest.raises(ConfigError, match="mask_token_id"):
        masking.arrange_plain(jax.random.key(0), *row, mask_token_id=None)
    with pytest.raises(ValueError, match="same shape"):
        masking.arrange_ar(np.zeros(4, np.int32), np.ones(5, np.int32), np.ones(4, bool))
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        masking.arrange_rows("ar", None, *row)
    with pytest.raises(ValueError, match="length"):
        masking.dual_stream_mask(0, 4)
    with pytest.raises(ConfigError, match="block_size"):
        masking.dual_stream_mask(4, 0)
