"""What the attention tests share (tests/test_tiled_attention.py, tests/test_flash_attention.py):
hypothesis settings and packed rows, the attention structure of a layout, random q / k / v, the
closeness check against the dense reference, and a tiny model with an arranged batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, strategies as st

from wedlm_jax import masking
from wedlm_jax.attention import tiled as ta
from wedlm_jax.config import ModelConfig

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)



@st.composite
def packed_rows(draw, batch, length):
    """segment_ids [batch, length]: documents of random lengths, padding runs anywhere."""
    rows = []
    for _ in range(batch):
        row, doc = [], 1
        while len(row) < length:
            n = draw(st.integers(1, length))
            if draw(st.integers(0, 4)) == 0:
                row += [0] * n
            else:
                row += [doc] * n
                doc += 1
        rows.append(row[:length])
    return np.asarray(rows, np.int32)


def structure_of(layout, seg, block_size):
    b, n = seg.shape
    if layout == "dual":
        return ta.dual_stream_structure(seg, block_size)
    if layout == "causal":
        return ta.causal_structure(jnp.asarray(seg), b, n)
    return _arranged_structure(jnp.asarray(seg), layout, block_size)


@functools.partial(jax.jit, static_argnames=("layout", "block_size"))
def _arranged_structure(seg, layout, block_size):
    keys = masking.row_keys(0, 0, jnp.arange(seg.shape[0]))
    arr = masking.arrange_rows(layout, keys, jnp.zeros_like(seg), seg, seg != 0,
                               block_size=block_size, mask_token_id=7)
    return ta.as_structure(arr)


def qkv(seed, b, s, t, h, kvh, d, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, s, h, d), dtype),
            jax.random.normal(ks[1], (b, t, kvh, d), dtype),
            jax.random.normal(ks[2], (b, t, kvh, d), dtype),
            jax.random.normal(ks[3], (b, s, h, d), dtype))


def assert_close(actual, expected, rtol=1e-5):
    """Elementwise within rtol, plus an absolute rtol * max(largest magnitude, 1): the inputs are
    O(1), and exact zeros of the reference (e.g. dq of a query that sees a single key) come out of
    a different summation order as rounding noise."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert np.all(np.isfinite(actual))
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


TINY = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mask_token_id=63)


def arranged_batch(objective):
    b, n = 2, 24
    tokens = jax.random.randint(jax.random.key(1), (b, n), 0, 60)
    seg = jnp.asarray([[1] * 10 + [2] * 11 + [0] * 3, [3] * 24], jnp.int32)
    return masking.arrange_rows(objective, masking.row_keys(0, 3, jnp.arange(b)), tokens, seg,
                                seg != 0, block_size=4, mask_token_id=63)
