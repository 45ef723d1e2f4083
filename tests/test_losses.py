"""Losses (wedlm_jax.losses) against a plain NumPy computation on the same arrangement."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wedlm_jax import losses, masking
from wedlm_jax.config import ConfigError
from tests import xla

VOCAB, MASK_ID = 50, 49
SEG = np.array([[1] * 9 + [2] * 5 + [0] * 2,
                [3] * 16,
                [1] * 4 + [0] * 12], np.int32)
B, L = SEG.shape


@functools.lru_cache(maxsize=None)
def arrange_fn(objective):
    return jax.jit(lambda k, t, s, m: masking.arrange_rows(
        objective, k, t, s, m, block_size=3, mask_token_id=MASK_ID))


@functools.lru_cache(maxsize=None)
def terms_fn():
    return jax.jit(losses.loss_terms)


def make(objective, maskable=None, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MASK_ID, (B, L)).astype(np.int32)
    if maskable is None:
        maskable = (SEG != 0) & (rng.random((B, L)) < 0.8)
    keys = masking.row_keys(seed, 1, jnp.arange(B))
    arr = {k: np.array(v) for k, v in arrange_fn(objective)(keys, tokens, SEG, maskable).items()}
    logits = (3 * rng.standard_normal(arr["tokens"].shape + (VOCAB,))).astype(np.float32)
    return tokens, maskable, arr, logits


def np_log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def reference(objective, tokens, maskable, arr, logits, w):
    """Loops: MLM over masked prediction slots (target = original token of the slot's source,
    weight 1/ratio), AR over memory slots whose next token is in the same document and trained."""
    mlm_num = mlm_den = ar_num = ar_den = correct = count = 0.0
    n_mem = L if objective in ("dual", "ar") else 0
    for b in range(B):
        for t in range(arr["tokens"].shape[1]):
            lp = np_log_softmax(logits[b, t])
            if arr["is_masked"][b, t]:
                target = tokens[b, arr["source"][b, t]]
                weight = 1.0 / float(arr["ratio"][b, t])
                mlm_num += weight * -lp[target]
                mlm_den += weight
                correct += float(np.argmax(logits[b, t]) == target)
                count += 1
            if t < n_mem and t + 1 < L and SEG[b, t] != 0 and SEG[b, t + 1] == SEG[b, t] \
                    and maskable[b, t + 1]:
                ar_num += -lp[tokens[b, t + 1]]
                ar_den += 1
    mlm = mlm_num / mlm_den if mlm_den else 0.0
    ar = ar_num / ar_den if ar_den else 0.0
    total = {"dual": (mlm + w * ar) / (1 + w), "plain": mlm, "ar": ar}[objective]
    acc = correct / count if count else 0.0
    return total, {"mlm_loss": mlm, "ar_loss": ar, "masked_accuracy": acc, "masked_count": count,
                   "mlm_weight": mlm_den, "ar_count": ar_den}


@pytest.mark.parametrize("objective,w", [("dual", 1.0), ("dual", 0.0), ("dual", 2.5),
                                         ("plain", 1.0), ("ar", 1.0)])
def test_losses_match_numpy(objective, w):
    tokens, maskable, arr, logits = make(objective)
    terms = terms_fn()(jnp.asarray(logits), arr)
    loss, metrics = losses.combine(terms, w, objective=objective)
    want, want_m = reference(objective, tokens, maskable, arr, logits, w)
    if objective != "ar":
        assert want_m["masked_count"] > 0
    if objective != "plain":
        assert want_m["ar_count"] > 0
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    for k in ("mlm_loss", "ar_loss", "masked_accuracy", "masked_count"):
        np.testing.assert_allclose(float(metrics[k]), want_m[k], rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(float(terms["mlm_weight"]), want_m["mlm_weight"], rtol=1e-5)
    np.testing.assert_allclose(float(terms["ar_count"]), want_m["ar_count"], rtol=1e-6)


def test_w_zero_is_mlm_and_ar_objective_is_ar():
    _, _, arr, logits = make("dual")
    terms = terms_fn()(jnp.asarray(logits), arr)
    loss0, m0 = losses.combine(terms, 0.0)
    np.testing.assert_allclose(float(loss0), float(m0["mlm_loss"]), rtol=1e-7)
    loss_ar, m_ar = losses.combine(terms, 3.0, objective="ar")
    np.testing.assert_allclose(float(loss_ar), float(m_ar["ar_loss"]), rtol=1e-7)
    assert float(m0["mlm_loss"]) != float(m0["ar_loss"])


def test_accuracy_counts_argmax_hits():
    _, _, arr, logits = make("dual")
    # make the logits at every other masked slot peak at the target
    masked = np.argwhere(arr["is_masked"])
    hit = masked[::2]
    for b, t in hit:
        logits[b, t, arr["targets"][b, t]] = 100.0
    terms = terms_fn()(jnp.asarray(logits), arr)
    assert float(terms["masked_count"]) == len(masked)
    assert len(hit) > 0
    argmax_hits = sum(int(np.argmax(logits[b, t]) == arr["targets"][b, t]) for b, t in masked)
    assert argmax_hits >= len(hit)
    assert float(terms["masked_correct"]) == argmax_hits


def test_ar_accuracy_counts_next_token_hits_where_ar_is_trained():
    _, _, arr, logits = make("dual")
    trained = np.argwhere(np.asarray(arr["ar_weight"]) > 0)
    for b, t in trained[::3]:
        logits[b, t, arr["ar_targets"][b, t]] = 100.0
    terms = terms_fn()(jnp.asarray(logits), arr)
    hits = sum(int(np.argmax(logits[b, t]) == arr["ar_targets"][b, t]) for b, t in trained)
    assert hits >= len(trained[::3]) > 0 and float(terms["ar_correct"]) == hits
    _, m = losses.combine(terms, 1.0)
    np.testing.assert_allclose(float(m["ar_accuracy"]), hits / float(terms["ar_count"]), rtol=1e-6)


def test_nothing_masked_gives_zero_loss_and_finite_gradients():
    maskable = np.zeros((B, L), bool)
    _, _, arr, logits = make("dual", maskable=maskable)
    assert not arr["is_masked"].any() and not arr["ar_weight"].any()

    def loss_of(lg):
        return losses.combine(losses.loss_terms(lg, arr), 1.0)[0]

    loss, grad = jax.jit(jax.value_and_grad(loss_of))(jnp.asarray(logits))
    assert float(loss) == 0.0
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad).any()
    _, metrics = losses.combine(losses.loss_terms(jnp.asarray(logits), arr), 1.0)
    for k, v in metrics.items():
        assert np.isfinite(float(v)), k
    assert float(metrics["masked_accuracy"]) == 0.0


def test_no_masked_slot_but_ar_targets_gives_the_ar_part_and_finite_gradients():
    # an arrangement whose draw masked nothing (masks removed by hand) but has AR targets
    _, _, arr, logits = make("dual", seed=3)
    arr["is_masked"][:] = False
    arr["mlm_weight"][:] = 0.0

    def loss_of(lg):
        return losses.combine(losses.loss_terms(lg, arr), 2.0)

    (loss, metrics), grad = jax.value_and_grad(loss_of, has_aux=True)(jnp.asarray(logits))
    assert float(metrics["mlm_loss"]) == 0.0 and float(metrics["ar_loss"]) > 0
    np.testing.assert_allclose(float(loss), 2.0 * float(metrics["ar_loss"]) / 3.0, rtol=1e-6)
    grad = np.asarray(grad)
    assert np.isfinite(grad).all()
    assert not grad[:, L:].any(), "no gradient reaches the prediction stream"


def test_totals_make_microbatch_losses_add_up():
    _, _, arr, logits = make("dual", seed=5)
    full, _ = losses.combine(terms_fn()(jnp.asarray(logits), arr), 1.0)
    totals = losses.weight_totals(arr)
    parts = 0.0
    for rows in ([0], [1, 2]):
        sub = {k: v[rows] for k, v in arr.items()}
        terms = losses.loss_terms(jnp.asarray(logits[rows]), sub)
        parts += float(losses.combine(terms, 1.0, totals=totals)[0])
    np.testing.assert_allclose(parts, float(full), rtol=1e-5)
    # summing the terms of the microbatches and combining once gives the same
    summed = jax.tree.map(lambda *x: sum(x), *[
        losses.loss_terms(jnp.asarray(logits[rows]), {k: v[rows] for k, v in arr.items()})
        for rows in ([0, 1], [2])])
    np.testing.assert_allclose(float(losses.combine(summed, 1.0)[0]), float(full), rtol=1e-5)


def test_gradient_matches_numpy_on_one_slot():
    # d loss / d logits at a masked slot = w / W * (softmax - onehot) / (1 + w_ar)
    _, _, arr, logits = make("dual", seed=2)
    grad = np.asarray(jax.grad(lambda lg: losses.combine(losses.loss_terms(lg, arr), 1.0)[0])(
        jnp.asarray(logits)))
    b, t = np.argwhere(arr["is_masked"])[0]
    weights = 1.0 / arr["ratio"][arr["is_masked"]].astype(np.float64)
    p = np.exp(np_log_softmax(logits[b, t]))
    onehot = np.eye(VOCAB)[arr["targets"][b, t]]
    want = (1.0 / arr["ratio"][b, t]) / weights.sum() * (p - onehot) / 2.0
    np.testing.assert_allclose(grad[b, t], want, rtol=1e-4, atol=1e-7)


def test_bad_input():
    _, _, arr, logits = make("dual")
    terms = terms_fn()(jnp.asarray(logits), arr)
    with pytest.raises(ConfigError, match="ar_weight"):
        losses.combine(terms, -1.0)
    with pytest.raises(ConfigError, match="objective"):
        losses.combine(terms, 1.0, objective="mlm")
    with pytest.raises(ValueError, match="do not match"):
        losses.loss_terms(jnp.asarray(logits[:, :5]), arr)


@pytest.mark.parametrize("objective,chunk", [("dual", 8), ("dual", 1), ("ar", 4)])
def test_chunked_loss_equals_full_logits_in_value_and_gradient(objective, chunk):
    """The loss formed `chunk` slots at a time (never the full logits) is the full-logits loss:
    the same sums, and the same gradients with respect to the hidden states and the head."""
    _, _, arr, _ = make(objective, seed=3)
    rng = np.random.default_rng(7)
    hidden = jnp.asarray(rng.standard_normal(arr["tokens"].shape + (12,)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((12, VOCAB)), jnp.float32)
    logits_of = lambda h, w: jnp.einsum("bte,ev->btv", h, w)
    name = {"dual": "dual", "ar": "ar"}[objective]

    def full(h, w):
        return losses.combine(losses.loss_terms(logits_of(h, w), arr), 1.0, objective=name)[0]

    def chunked(h, w):
        terms = losses.chunked_loss_terms(h, arr, chunk, lambda x: logits_of(x, w))
        return losses.combine(terms, 1.0, objective=name)[0]

    want_terms = losses.loss_terms(logits_of(hidden, head), arr)
    got_terms = jax.jit(lambda h, w: losses.chunked_loss_terms(
        h, arr, chunk, lambda x: logits_of(x, w)))(hidden, head)
    for k in losses.TERM_KEYS:
        np.testing.assert_allclose(float(got_terms[k]), float(want_terms[k]), rtol=1e-5, err_msg=k)
    assert float(want_terms["ar_count"]) > 0
    want_v, want_g = jax.value_and_grad(full, argnums=(0, 1))(hidden, head)
    got_v, got_g = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, head)
    np.testing.assert_allclose(float(got_v), float(want_v), rtol=1e-6)
    assert float(jnp.abs(want_g[1]).max()) > 1e-4      # gradients are not trivially zero
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-7)


def test_chunked_loss_refuses_a_chunk_that_does_not_divide_the_slots():
    _, _, arr, _ = make("dual")
    hidden = jnp.zeros(arr["tokens"].shape + (4,))
    with pytest.raises(ValueError, match="loss chunk 5 must be >= 1 and divide the 32 slots"):
        losses.chunked_loss_terms(hidden, arr, 5, lambda x: x)
    with pytest.raises(ValueError, match="does not match the arrangement"):
        losses.chunked_loss_terms(hidden[:, :8], arr, 4, lambda x: x)


SHARDED_SCRIPT = r"""
import os, sys, json
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from wedlm_jax import losses, sharding
data = dict(np.load(sys.argv[1]))
logits = data.pop("logits")
mesh = sharding.make_mesh(2, 1, 1)
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
logits, arr = put(logits), {k: put(v) for k, v in data.items()}
assert len(logits.sharding.device_set) == 2
f = jax.jit(lambda lg, a: losses.combine(losses.loss_terms(lg, a), 1.0))
loss, metrics = f(logits, arr)
print(json.dumps({"loss": float(loss), "mlm": float(metrics["mlm_loss"]),
                  "ar": float(metrics["ar_loss"])}))
"""


def test_sums_are_global_under_sharding(tmp_path):
    """Two CPU devices, one row each: the loss is normalised over the global batch, not per
    device (the per-row means differ from the global one, so the check can fail)."""
    _, _, arr, logits = make("dual", seed=6)
    rows = [0, 2]  # rows with different weight sums
    arr = {k: v[rows] for k, v in arr.items() if k in
           ("targets", "is_masked", "mlm_weight", "ar_targets", "ar_weight")}
    logits = logits[rows]
    path = tmp_path / "batch.npz"
    np.savez(path, logits=logits, **arr)
    env = dict(os.environ, XLA_FLAGS=xla.flags(2),
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, str(path)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    loss, metrics = losses.combine(losses.loss_terms(jnp.asarray(logits), arr), 1.0)
    np.testing.assert_allclose(got["loss"], float(loss), rtol=1e-5)
    np.testing.assert_allclose(got["mlm"], float(metrics["mlm_loss"]), rtol=1e-5)
    np.testing.assert_allclose(got["ar"], float(metrics["ar_loss"]), rtol=1e-5)
    per_row = [float(losses.combine(losses.loss_terms(
        jnp.asarray(logits[i:i + 1]), {k: v[i:i + 1] for k, v in arr.items()}), 1.0)[0])
        for i in range(2)]
    assert abs(np.mean(per_row) - float(loss)) > 1e-3
