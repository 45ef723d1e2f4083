"""The attention rules of training's dual-stream arrangement (docs/algorithm.md §2: who may attend
to whom, packed rows and padding), written rule by rule as Python loops, independently of the
vectorised code (wedlm_jax.masking): the brute-force masks tests/test_masking.py and
tests/test_no_leak.py compare against."""

import numpy as np


def brute_documents(segment_ids):
    """Python loops: per token (document key or None for padding, position in its document).
    A document is a maximal run of equal non-zero ids; the key is the run's start index."""
    docs, pos = [], []
    start = 0
    for i, s in enumerate(segment_ids):
        if i == 0 or s != segment_ids[i - 1]:
            start = i
        docs.append(None if s == 0 else start)
        pos.append(i - start)
    return docs, pos


def brute_dual_mask(segment_ids, block_size, source):
    """Rule by rule, docs/algorithm.md §2 (who may attend to whom; packed rows and padding).
    Slot j < L is memory slot of token j; slot j >= L is the
    prediction slot carrying token source[j] (the reorder the arrangement chose)."""
    n = len(segment_ids)
    docs, pos = brute_documents(list(segment_ids))
    slots = [("mem", j) for j in range(n)] + [("pred", int(source[j])) for j in range(n, 2 * n)]
    m = np.zeros((2 * n, 2 * n), bool)
    for q in range(2 * n):
        q_kind, q_tok = slots[q]
        for k in range(2 * n):
            k_kind, k_tok = slots[k]
            if docs[q_tok] is None or docs[q_tok] != docs[k_tok]:
                continue
            q_block = pos[q_tok] // block_size
            if q_kind == "mem" and k_kind == "mem":
                m[q, k] = k <= q
            elif q_kind == "pred" and k_kind == "mem":
                m[q, k] = pos[k_tok] < q_block * block_size
            elif q_kind == "pred" and k_kind == "pred":
                m[q, k] = pos[k_tok] // block_size == q_block and k <= q
            else:
                m[q, k] = False
    return m


def brute_causal_doc_mask(segment_ids, source):
    """Causal in physical order within a document (plain 4.1 and AR arrangements)."""
    n = len(segment_ids)
    docs, _ = brute_documents(list(segment_ids))
    m = np.zeros((n, n), bool)
    for q in range(n):
        for k in range(n):
            dq, dk = docs[int(source[q])], docs[int(source[k])]
            m[q, k] = dq is not None and dq == dk and k <= q
    return m
