"""Training arrangements: dual-stream masking with topological reordering (docs/algorithm.md §2).

Everything here is pure, jittable and of static shape. One training row of length `L` (packed) is
described by

    tokens       int32[L]   token ids
    segment_ids  int32[L]   document id per token (1, 2, ...; 0 = padding). A document is a maximal
                            run of equal non-zero ids; positions restart at 0 at each document's
                            start and blocks count from it.
    maskable     bool[L]    False on prompt tokens (SFT) and on padding: never masked, never a target

and is turned into an *arrangement*: a dict of per-slot arrays of the sequence fed to the network.
Three objectives share the same description:

    "dual"   (section 4.2) `[memory stream of the whole row ; prediction stream of the whole row]`,
             length 2L: the memory stream is the clean row; the prediction stream holds each
             document's blocks, each block reordered observed-first-then-masks (positions carried).
    "plain"  (section 4.1) length L: one mask ratio per document, the whole document reordered
             observed-first-then-masks, ordinary causal attention within each document.
    "ar"     length L: the row itself with causal attention within each document (a plain causal LM).

The attention pattern is a pure function of the per-slot *structure* (`structure_mask`):

    segment  int32   document number within the row (1, 2, ...; 0 = padding)
    stream   int32   0 = memory stream, 1 = prediction stream
    block    int32   block index within the slot's document (position // block_size)
    index    int32   physical index of the slot (0 .. T-1)

with the rules of docs/algorithm.md §2: a query sees a key only when both are in the same document (neither is
padding) and
    memory -> memory          key index <= query index (causal);
    prediction -> memory      key block < query block (the clean history of earlier blocks);
    prediction -> prediction  same block and key index <= query index (causal in reordered order);
    memory -> prediction      never.
"plain" is the special case of prediction slots all in block 0 (causal within a document), "ar"
of memory slots only.

Beyond the structure (and `positions`), an arrangement carries the loss inputs read by
`wedlm_jax.losses`:
    tokens      int32[T]  the network input ([MASK] = `mask_token_id` at masked slots)
    positions   int32[T]  logical positions (RoPE)
    targets     int32[T]  the original token at the slot's position (mask reading: no shift)
    is_masked   bool[T]   a [MASK] slot of the prediction stream
    mlm_weight  f32[T]    1/g on masked slots (g the ratio of the slot's block), 0 elsewhere
    ar_targets  int32[T]  memory stream: the next token of the same document; 0 elsewhere
    ar_weight   f32[T]    1 where that next token exists and is maskable (trained), 0 elsewhere
    ratio       f32[T]    g of the slot's block (1 in "ar"; for inspection)
    source      int32[T]  index in the original row of the token the slot carries
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from wedlm_jax.config import ConfigError

OBJECTIVES = ("dual", "plain", "ar")
STRUCTURE_KEYS = ("segment", "stream", "block", "index")
MEMORY, PREDICTION = 0, 1


# ----------------------------------------------------------------------------------- validation

def validate_options(*, objective: str = "dual", block_size: int = 32, ar_weight: float = 1.0,
                     eps: float = 1e-3, mask_token_id: int | None = None,
                     vocab_size: int | None = None) -> None:
    """Raise `ConfigError` naming the field and its allowed values for any bad training option.
    Pure Python: call it from the config layer, before anything is compiled."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ConfigError(f"block_size must be an integer >= 1; got {block_size!r}")
    if (isinstance(ar_weight, bool) or not isinstance(ar_weight, numbers.Real)
            or not np.isfinite(ar_weight) or ar_weight < 0):
        raise ConfigError(f"ar_weight (the AR loss weight w) must be a finite number >= 0; "
                          f"got {ar_weight!r}")
    if not isinstance(eps, numbers.Real) or not 0 < eps <= 1:
        raise ConfigError(f"eps (the smallest mask ratio) must be in (0, 1]; got {eps!r}")
    if objective != "ar":
        if (mask_token_id is None or isinstance(mask_token_id, bool)
                or not isinstance(mask_token_id, numbers.Integral) or mask_token_id < 0):
            raise ConfigError(f"mask_token_id must be an integer >= 0 for objective {objective!r}; "
                              f"got {mask_token_id!r}")
        if vocab_size is not None and mask_token_id >= vocab_size:
            raise ConfigError(f"mask_token_id must be in [0, {vocab_size}) (the vocabulary); "
                              f"got {mask_token_id}")


def _check_row(tokens, segment_ids, maskable):
    for name, a in (("tokens", tokens), ("segment_ids", segment_ids), ("maskable", maskable)):
        if np.ndim(a) != 1:
            raise ValueError(f"{name} must be one row of shape [L]; got shape {np.shape(a)} "
                             f"(use arrange_rows for a batch)")
    if not (np.shape(tokens) == np.shape(segment_ids) == np.shape(maskable)):
        raise ValueError(f"tokens, segment_ids and maskable must have the same shape; got "
                         f"{np.shape(tokens)}, {np.shape(segment_ids)}, {np.shape(maskable)}")
    if np.shape(tokens)[0] < 1:
        raise ValueError("a row must hold at least one token")


# ------------------------------------------------------------------------------------ documents

def documents(segment_ids: jnp.ndarray):
    """Per token of a row: (document number 1, 2, ... with 0 for padding, position within its
    document, run index 0, 1, ... of its maximal run of equal segment ids, padding runs included)."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    n = seg.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), seg[1:] != seg[:-1]])
    run = jnp.cumsum(starts.astype(jnp.int32)) - 1
    doc = jnp.cumsum((starts & (seg != 0)).astype(jnp.int32))
    doc = jnp.where(seg != 0, doc, 0)
    first = jax.lax.cummax(jnp.where(starts, idx, 0))
    return doc, idx - first, run


def _memory_structure(segment_ids, block_size):
    doc, pos, run = documents(segment_ids)
    return doc, pos, pos // block_size, run


# ------------------------------------------------------------------------------ attention mask

def pair_mask(q_struct, k_struct):
    """THE attention rule, bool [..., S, T]: may query s (structure `q_struct`, arrays [..., S])
    see key t (`k_struct`, arrays [..., T])? Same document (query segment != 0) and one of
        memory -> memory          key index <= query index
        prediction -> memory      key block < query block
        prediction -> prediction  same block and key index <= query index
    (memory -> prediction never). The dense masks (`structure_mask`), the tile-skipping kernel
    (`tiled_attention`) and the splash templates all evaluate this one function. JAX arrays
    (traced or not) give a JAX array; NumPy arrays give a NumPy array (host side)."""
    arr = lambda a: a if isinstance(a, jax.Array) else np.asarray(a)
    q = lambda name: arr(q_struct[name])[..., :, None]
    k = lambda name: arr(k_struct[name])[..., None, :]
    same_doc = (q("segment") == k("segment")) & (q("segment") != 0)
    causal = k("index") <= q("index")
    q_mem, k_mem = q("stream") == MEMORY, k("stream") == MEMORY
    mem_mem = q_mem & k_mem & causal
    pred_mem = ~q_mem & k_mem & (k("block") < q("block"))
    pred_pred = ~q_mem & ~k_mem & (k("block") == q("block")) & causal
    return same_doc & (mem_mem | pred_mem | pred_pred)


def structure_mask(structure) -> jnp.ndarray:
    """Dense boolean attention mask [..., T, T] (query, key) of a structure: any mapping with the
    int arrays `segment`, `stream`, `block`, `index` of shape [..., T] (an arrangement works
    as is; leading batch dims broadcast): `pair_mask(structure, structure)`. Rules: see the
    module docstring / docs/algorithm.md §2. JAX arrays give a JAX array (jittable); NumPy arrays give a
    NumPy array (host side)."""
    return pair_mask(structure, structure)


def dual_stream_structure(segment_ids: jnp.ndarray, block_size: int) -> dict:
    """The structure (`segment`, `stream`, `block`, `index`) of the dual-stream arrangement of one
    row [L] -> arrays [2L]. It does not depend on which tokens are masked: reordering moves slots
    only within their block, and the rules look at blocks and physical order only."""
    validate_options(block_size=block_size, mask_token_id=0)
    doc, _, block, _ = _memory_structure(segment_ids, block_size)
    n = doc.shape[0]
    return {
        "segment": jnp.concatenate([doc, doc]),
        "stream": jnp.concatenate([jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.int32)]),
        "block": jnp.concatenate([block, block]),
        "index": jnp.arange(2 * n, dtype=jnp.int32),
    }


def dual_stream_mask(length: int, block_size: int) -> np.ndarray:
    """The dense dual-stream attention mask of ONE document of `length` tokens, bool[2L, 2L]
    (query, key), slots `[memory 0..L-1 ; prediction L..2L-1]`.

    Rows 0..L-1 (memory) are causal over the memory stream; a prediction slot of block b
    (block k covers positions k*B .. min(L, (k+1)B) - 1) sees the memory slots of positions < b*B
    and the prediction slots of its own block up to itself; memory never sees prediction. It is the
    same for every masking draw (see `dual_stream_structure`). For tests and inspection."""
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 1:
        raise ValueError(f"length must be an integer >= 1; got {length!r}")
    validate_options(block_size=block_size, mask_token_id=0)
    block = np.arange(length) // block_size
    return structure_mask({
        "segment": np.ones(2 * length, np.int32),
        "stream": np.repeat(np.array([MEMORY, PREDICTION], np.int32), length),
        "block": np.concatenate([block, block]),
        "index": np.arange(2 * length),
    })


# -------------------------------------------------------------------------------- arrangements

def _draw_masks(rng, groups, ratio_index, maskable, eps):
    """Per token: (ratio g of its group, masked?). `groups` are contiguous, ascending group ids
    (the unit of reordering and counting); `ratio_index` picks which of L independent ratios a
    token's group uses (its group, or its document when one ratio is shared per document)."""
    n = groups.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    k_ratio, k_rank = jax.random.split(rng)
    ratios = jnp.maximum(1.0 - jax.random.uniform(k_ratio, (n,), jnp.float32), eps)  # U(0, 1]
    g = ratios[ratio_index]
    n_maskable = jax.ops.segment_sum(maskable.astype(jnp.int32), groups, num_segments=n)[groups]
    n_masked = jnp.round(g * n_maskable.astype(jnp.float32)).astype(jnp.int32)
    # A uniform subset of size n_masked among a group's maskable tokens: the n_masked smallest of
    # i.i.d. uniform keys. Sort by (group, non-maskable last, key); the rank within the group is the
    # sorted index minus the group's first index (groups are contiguous ranges of the row).
    keys = jax.random.uniform(k_rank, (n,), jnp.float32)
    order = jnp.lexsort((idx, keys, (~maskable).astype(jnp.int32), groups))
    group_first = jax.lax.cummax(jnp.where(jnp.concatenate(
        [jnp.ones((1,), bool), groups[1:] != groups[:-1]]), idx, 0))
    rank = idx - group_first[order]
    chosen = maskable[order] & (rank < n_masked[order])
    is_masked = jnp.zeros(n, bool).at[order].set(chosen)
    return g, is_masked


def _reorder(groups, is_masked):
    """Permutation (new slot -> original index): within each group, observed tokens first then
    masked ones, each ascending."""
    idx = jnp.arange(groups.shape[0], dtype=jnp.int32)
    return jnp.lexsort((idx, is_masked.astype(jnp.int32), groups)).astype(jnp.int32)


def _ar_targets(tokens, doc, maskable):
    nxt = jnp.concatenate([tokens[1:], jnp.zeros((1,), tokens.dtype)])
    nxt_doc = jnp.concatenate([doc[1:], jnp.zeros((1,), doc.dtype)])
    nxt_trained = jnp.concatenate([maskable[1:], jnp.zeros((1,), bool)])
    ok = (doc != 0) & (nxt_doc == doc) & nxt_trained
    return jnp.where(ok, nxt, 0).astype(jnp.int32), ok.astype(jnp.float32)


def _prediction_stream(rng, tokens, maskable, groups, ratio_index, mask_token_id, eps):
    g, is_masked = _draw_masks(rng, groups, ratio_index, maskable, eps)
    perm = _reorder(groups, is_masked)
    masked_p = is_masked[perm]
    return {
        "tokens": jnp.where(masked_p, mask_token_id, tokens[perm]).astype(jnp.int32),
        "targets": tokens[perm],
        "is_masked": masked_p,
        "mlm_weight": jnp.where(masked_p, 1.0 / g[perm], 0.0).astype(jnp.float32),
        "ratio": g[perm],
        "source": perm,
    }


def arrange_dual_stream(rng, tokens, segment_ids, maskable, *, block_size: int,
                        mask_token_id: int, mask_per_block: bool = True,
                        eps: float = 1e-3) -> dict:
    """The dual-stream arrangement (docs/algorithm.md §2, the paper's 4.2) of one row [L] -> dict of [2L].

    Per block (of `block_size` tokens from its document's start) draws g ~ U(0, 1] clamped to
    >= eps (one g per document when `mask_per_block` is False), masks round(g * n) of the block's
    n maskable tokens chosen uniformly, reorders the block observed-first-then-masks (positions
    carried) and returns `[memory stream ; prediction stream]` with the structure and loss inputs
    listed in the module docstring. `rng` is one PRNG key (see `row_keys`); vmap over rows."""
    validate_options(block_size=block_size, eps=eps, mask_token_id=mask_token_id)
    _check_row(tokens, segment_ids, maskable)
    tokens = jnp.asarray(tokens, jnp.int32)
    n = tokens.shape[0]
    doc, pos, block, run = _memory_structure(segment_ids, block_size)
    maskable = jnp.asarray(maskable, bool) & (doc != 0)
    groups = jnp.cumsum((pos % block_size == 0).astype(jnp.int32)) - 1
    pred = _prediction_stream(rng, tokens, maskable, groups,
                              groups if mask_per_block else run, mask_token_id, eps)
    ar_t, ar_w = _ar_targets(tokens, doc, maskable)
    zeros_i, zeros_f = jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.float32)
    perm = pred["source"]
    return {
        "tokens": jnp.concatenate([tokens, pred["tokens"]]),
        "positions": jnp.concatenate([pos, pos[perm]]),
        "segment": jnp.concatenate([doc, doc[perm]]),
        "stream": jnp.concatenate([zeros_i, jnp.ones(n, jnp.int32)]),
        "block": jnp.concatenate([block, block[perm]]),
        "index": jnp.arange(2 * n, dtype=jnp.int32),
        "targets": jnp.concatenate([tokens, pred["targets"]]),
        "is_masked": jnp.concatenate([jnp.zeros(n, bool), pred["is_masked"]]),
        "mlm_weight": jnp.concatenate([zeros_f, pred["mlm_weight"]]),
        "ar_targets": jnp.concatenate([ar_t, zeros_i]),
        "ar_weight": jnp.concatenate([ar_w, zeros_f]),
        "ratio": jnp.concatenate([jnp.ones(n, jnp.float32), pred["ratio"]]),
        "source": jnp.concatenate([jnp.arange(n, dtype=jnp.int32), perm]),
    }


def arrange_plain(rng, tokens, segment_ids, maskable, *, mask_token_id: int,
                  eps: float = 1e-3) -> dict:
    """The plain arrangement of section 4.1 for one row [L] -> dict of [L]: one ratio
    g ~ U(0, 1] (>= eps) per document, round(g * n) of the document's n maskable tokens masked
    uniformly, the whole document reordered observed-first-then-masks (positions carried), causal
    attention within the document (all slots are prediction slots of block 0). No AR stream:
    `ar_weight` is all zero."""
    validate_options(objective="plain", eps=eps, mask_token_id=mask_token_id)
    _check_row(tokens, segment_ids, maskable)
    tokens = jnp.asarray(tokens, jnp.int32)
    n = tokens.shape[0]
    doc, pos, run = documents(segment_ids)
    maskable = jnp.asarray(maskable, bool) & (doc != 0)
    pred = _prediction_stream(rng, tokens, maskable, run, run, mask_token_id, eps)
    perm = pred["source"]
    return {
        "tokens": pred["tokens"],
        "positions": pos[perm],
        "segment": doc[perm],
        "stream": jnp.ones(n, jnp.int32),
        "block": jnp.zeros(n, jnp.int32),
        "index": jnp.arange(n, dtype=jnp.int32),
        "targets": pred["targets"],
        "is_masked": pred["is_masked"],
        "mlm_weight": pred["mlm_weight"],
        "ar_targets": jnp.zeros(n, jnp.int32),
        "ar_weight": jnp.zeros(n, jnp.float32),
        "ratio": pred["ratio"],
        "source": perm,
    }


def arrange_ar(tokens, segment_ids, maskable) -> dict:
    """The AR-only arrangement of one row [L] -> dict of [L]: the row itself (memory slots, causal
    within each document) with next-token targets on maskable (trained) tokens; nothing masked."""
    _check_row(tokens, segment_ids, maskable)
    tokens = jnp.asarray(tokens, jnp.int32)
    n = tokens.shape[0]
    doc, pos, _ = documents(segment_ids)
    maskable = jnp.asarray(maskable, bool) & (doc != 0)
    ar_t, ar_w = _ar_targets(tokens, doc, maskable)
    return {
        "tokens": tokens,
        "positions": pos,
        "segment": doc,
        "stream": jnp.zeros(n, jnp.int32),
        "block": jnp.zeros(n, jnp.int32),
        "index": jnp.arange(n, dtype=jnp.int32),
        "targets": tokens,
        "is_masked": jnp.zeros(n, bool),
        "mlm_weight": jnp.zeros(n, jnp.float32),
        "ar_targets": ar_t,
        "ar_weight": ar_w,
        "ratio": jnp.ones(n, jnp.float32),
        "source": jnp.arange(n, dtype=jnp.int32),
    }


def arranged_length(objective: str, length: int) -> int:
    """Length T of the arranged sequence for rows of `length` tokens."""
    validate_options(objective=objective, mask_token_id=0)
    return 2 * length if objective == "dual" else length


def arrange_rows(objective: str, keys, tokens, segment_ids, maskable, *, block_size: int = 32,
                 mask_token_id: int | None = None, mask_per_block: bool = True,
                 eps: float = 1e-3) -> dict:
    """Arrange a batch [B, L] with one PRNG key per row (`keys` [B], see `row_keys`; ignored for
    "ar") -> dict of [B, T], T = `arranged_length(objective, L)`. Jittable; the keyword options
    are static."""
    validate_options(objective=objective, block_size=block_size, eps=eps,
                     mask_token_id=mask_token_id)
    if np.ndim(tokens) != 2:
        raise ValueError(f"tokens must be a batch of shape [B, L]; got shape {np.shape(tokens)}")
    if objective == "ar":
        return jax.vmap(arrange_ar)(tokens, segment_ids, maskable)
    if objective == "plain":
        fn = functools.partial(arrange_plain, mask_token_id=mask_token_id, eps=eps)
    else:
        fn = functools.partial(arrange_dual_stream, block_size=block_size,
                               mask_token_id=mask_token_id, mask_per_block=mask_per_block, eps=eps)
    return jax.vmap(fn)(keys, tokens, segment_ids, maskable)


def attention_mask(arrangement) -> jnp.ndarray:
    """The dense mask [..., T, T] of an arrangement (single row or batch): `structure_mask`."""
    return structure_mask(arrangement)


def row_keys(seed: int, step, global_indices) -> jax.Array:
    """One PRNG key per row from (seed, step, global example index): fold the step, then the
    example index, into `jax.random.key(seed)`. Independent of how many devices or hosts there
    are. `global_indices` int [B] -> typed keys [B]."""
    base = jax.random.fold_in(jax.random.key(seed), step)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(global_indices, jnp.int32))
