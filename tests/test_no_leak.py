"""No leak: a tiny random Transformer fed a dual-stream arrangement with its attention mask.
What a slot must not see does not change its logits; what it may see does (positive controls)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wedlm_jax import masking
from wedlm_jax.config import ModelConfig
from wedlm_jax.model import Transformer, init_params
from tests.mask_rules import brute_dual_mask

VOCAB, MASK_ID, BLOCK = 64, 63, 4
CONFIG = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     mask_token_id=MASK_ID)
# doc 1: 10 tokens (blocks 0,1,2), doc 2: 7 tokens (blocks 0,1), 3 padding
SEG = np.array([1] * 10 + [2] * 7 + [0] * 3, np.int32)
L = SEG.size
ATOL = 1e-6   # masked-out keys contribute exact zeros; the changes seen are >> this


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MASK_ID, L).astype(np.int32)
    # a draw that masks something, and leaves something observed, in doc 1's blocks 1 and 2,
    # and masks something in doc 1's block 0 and in doc 2
    n_keys = 64
    arrange = jax.jit(lambda k, t, s, m: masking.arrange_rows(
        "dual", k, t, s, m, block_size=BLOCK, mask_token_id=MASK_ID))
    draws = arrange(masking.row_keys(0, 0, jnp.arange(n_keys)), np.tile(tokens, (n_keys, 1)),
                    np.tile(SEG, (n_keys, 1)), np.tile(SEG != 0, (n_keys, 1)))
    draws = {k: np.asarray(v) for k, v in draws.items()}
    for i in range(n_keys):
        arr = {k: v[i] for k, v in draws.items()}
        m, blk, seg, pred = arr["is_masked"], arr["block"], arr["segment"], arr["stream"] == 1
        doc1 = lambda b: (seg == 1) & pred & (blk == b)
        if (all(m[doc1(b)].any() and (~m[doc1(b)]).any() for b in (1, 2))
                and m[doc1(0)].any() and m[seg == 2].any()):
            break
    else:
        raise AssertionError(f"no suitable draw among {n_keys} keys")
    params = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(1))
    model = Transformer(CONFIG)
    mask = masking.structure_mask({k: jnp.asarray(arr[k]) for k in masking.STRUCTURE_KEYS})

    @jax.jit
    def logits_of(token_batch):
        n = token_batch.shape[0]
        pos = jnp.broadcast_to(arr["positions"], token_batch.shape)
        return model.apply({"params": params}, token_batch, pos,
                           mask=jnp.broadcast_to(mask, (n,) + mask.shape))

    return arr, np.asarray(mask), logits_of


def changed_slots(logits_of, base_tokens, edits):
    """edits: list of {slot: new token}; returns bool [len(edits), T] of slots whose logits moved,
    and the max change per slot."""
    batch = np.repeat(base_tokens[None], len(edits) + 1, axis=0)
    for i, e in enumerate(edits):
        for slot, tok in e.items():
            batch[i + 1, slot] = tok
    out = np.asarray(logits_of(jnp.asarray(batch)))
    diff = np.abs(out[1:] - out[:1]).max(axis=-1)
    return diff > ATOL, diff


def other(tok):
    return (int(tok) + 17) % MASK_ID


def test_leaks(setup):
    arr, mask, logits_of = setup
    toks, src, m = arr["tokens"], arr["source"], arr["is_masked"]
    seg, blk, stream = arr["segment"], arr["block"], arr["stream"]
    pred = stream == 1
    masked_slots = np.nonzero(m)[0]

    edits, expect_unchanged, expect_changed = [], [], []
    # (1) the original token of each masked slot (it lives in the memory stream at `source`)
    for s in masked_slots:
        p = src[s]
        edits.append({p: other(toks[p])})
        same_doc = seg == seg[s]
        unchanged = (same_doc & pred & (blk <= blk[s])) | ~same_doc | (~pred & (np.arange(2 * L) < p))
        expect_unchanged.append(unchanged)
        assert unchanged[s] and unchanged[masked_slots[seg[masked_slots] != seg[s]]].all()
        # positive control: the memory slot itself and the next block's prediction slots move
        expect_changed.append((np.arange(2 * L) == p) | (same_doc & pred & (blk == blk[s] + 1)))
    # (2) the prediction stream of doc 1's block 0 (and block 1): later blocks do not see it
    for b in (0, 1):
        slots = np.nonzero((seg == 1) & pred & (blk == b))[0]
        edits.append({j: other(toks[j]) for j in slots})
        expect_unchanged.append(~((seg == 1) & pred & (blk == b)))
        expect_changed.append(np.isin(np.arange(2 * L), slots[-1:]))
    # (3) every token of document 1, both streams: nothing of document 2 or padding moves
    edits.append({j: other(toks[j]) for j in np.nonzero(seg == 1)[0]})
    expect_unchanged.append(seg != 1)
    expect_changed.append((seg == 1) & (blk == 0) & ~pred)
    # (4) positive controls: a visible token changes a masked slot's logits
    s = masked_slots[(seg[masked_slots] == 1) & (blk[masked_slots] == 1)][0]
    edits.append({0: other(toks[0])})   # memory, block 0: seen by every doc-1 block >= 1
    expect_unchanged.append(seg != 1)
    expect_changed.append(np.arange(2 * L) == s)
    first_obs = np.nonzero((seg == 1) & pred & (blk == 1) & ~m)[0][0]
    edits.append({first_obs: other(toks[first_obs])})  # observed slot before s in its block
    expect_unchanged.append(~((seg == 1) & pred & (blk == 1)))
    expect_changed.append(np.arange(2 * L) == s)

    # (5) prediction is causal within a block (as in decoding): the block's last slot (a mask)
    # is seen by nobody else of its block
    last = np.nonzero((seg == 1) & pred & (blk == 1))[0][-1]
    edits.append({last: other(toks[last])})
    expect_unchanged.append(np.arange(2 * L) != last)
    expect_changed.append(np.arange(2 * L) == last)

    moved, diff = changed_slots(logits_of, toks, edits)
    for i in range(len(edits)):
        leak = moved[i] & expect_unchanged[i]
        assert not leak.any(), f"edit {i} {edits[i]} leaked into slots {np.nonzero(leak)[0]}"
        missing = expect_changed[i] & ~moved[i]
        assert not missing.any(), f"edit {i} {edits[i]} did not reach {np.nonzero(missing)[0]}"
        assert diff[i][expect_changed[i]].min() > 1e-3


def test_influence_follows_the_mask(setup):
    """Change each input slot in turn: exactly the queries that the rules of docs/algorithm.md §2 (brute
    force, tests/mask_rules.py) let see it move (the dual-stream mask is transitively closed, so two layers add no
    indirect path)."""
    arr, mask, logits_of = setup
    np.testing.assert_array_equal(mask, brute_dual_mask(SEG, BLOCK, arr["source"]))
    closure = (mask.astype(np.int32) @ mask.astype(np.int32)) > 0
    np.testing.assert_array_equal(closure, mask)
    toks = arr["tokens"]
    edits = [{j: other(toks[j])} for j in range(2 * L)]
    moved, _ = changed_slots(logits_of, toks, edits)
    # moved[j, q]: editing slot j moved query q; allowed iff mask[q, j] (a padding slot sees no
    # key but still carries its own embedding through the residual stream)
    own_padding = np.diag(arr["segment"] == 0)
    np.testing.assert_array_equal(moved, mask.T | own_padding)
