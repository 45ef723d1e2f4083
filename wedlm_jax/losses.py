"""Losses of the training arrangements (docs/algorithm.md §2, losses).

    terms = loss_terms(logits, batch)        # sums over the whole (global) batch
    terms = chunked_loss_terms(hidden, batch, chunk, logits_of)   # the same, a chunk of slots at a time
    loss, metrics = combine(terms, ar_weight, objective="dual")

`batch` is an arrangement from `wedlm_jax.masking` (single row [T] or batch [B, T]); the keys read
are `targets`, `is_masked`, `mlm_weight`, `ar_targets`, `ar_weight`.

- MLM (mask reading, no shift): cross-entropy of the logits at each masked prediction slot against
  the original token of that slot's position, weighted by 1/g of its block, normalised by the sum
  of the weights: mlm = mlm_sum / mlm_weight.
- AR (AR reading): next-token cross-entropy on the memory stream over trained targets, mean over
  them: ar = ar_sum / ar_count.
- total = (mlm + w * ar) / (1 + w) for "dual" (w = 0 disables AR), mlm for "plain", ar for "ar".
  An empty denominator gives a term of 0 (never NaN) with finite gradients.

Normalisation is over the GLOBAL batch: the terms are plain sums, so under `jax.jit` on arrays
sharded across devices and hosts the sums (and thus the means) are global automatically. With
gradient accumulation, either sum the terms of all microbatches and `combine` once, or compute
the global denominators first with `weight_totals(batch)` and pass them as `totals=` to the
`combine` of each microbatch: the microbatch losses then add up exactly to the full-batch loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from wedlm_jax.masking import OBJECTIVES, validate_options

TERM_KEYS = ("mlm_sum", "mlm_weight", "ar_sum", "ar_count", "ar_correct", "masked_correct",
             "masked_count")


def _picked_ce(logits, lse, targets):
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse - picked


def loss_terms(logits: jnp.ndarray, batch) -> dict:
    """Sums over every slot of `logits` [..., T, V] (computed in float32): mlm_sum (sum of
    w * CE at masked slots), mlm_weight (sum of w), ar_sum, ar_count, masked_correct (argmax ==
    target at masked slots), masked_count, ar_correct (argmax == next token where the AR reading is
    trained: the two readings' accuracies side by side). Only the log-normaliser and the target logits are
    formed, never the full log-softmax."""
    logits = logits.astype(jnp.float32)
    if logits.shape[:-1] != batch["targets"].shape:
        raise ValueError(f"logits {logits.shape} do not match the arrangement "
                         f"{batch['targets'].shape} (expected [..., T, V] with T the slots)")
    lse = jax.nn.logsumexp(logits, axis=-1)
    mlm_w = batch["mlm_weight"].astype(jnp.float32)
    ar_w = batch["ar_weight"].astype(jnp.float32)
    is_masked = batch["is_masked"].astype(bool)
    mlm_ce = _picked_ce(logits, lse, batch["targets"])
    ar_ce = _picked_ce(logits, lse, batch["ar_targets"])
    top = jnp.argmax(logits, axis=-1)
    correct = is_masked & (top == batch["targets"])
    return {
        "mlm_sum": jnp.sum(jnp.where(mlm_w > 0, mlm_w * mlm_ce, 0.0)),
        "mlm_weight": jnp.sum(mlm_w),
        "ar_sum": jnp.sum(jnp.where(ar_w > 0, ar_w * ar_ce, 0.0)),
        "ar_count": jnp.sum(ar_w),
        "ar_correct": jnp.sum(jnp.where((ar_w > 0) & (top == batch["ar_targets"]), 1.0, 0.0)),
        "masked_correct": jnp.sum(correct.astype(jnp.float32)),
        "masked_count": jnp.sum(is_masked.astype(jnp.float32)),
    }


LOSS_KEYS = ("targets", "is_masked", "mlm_weight", "ar_targets", "ar_weight")


def chunked_loss_terms(hidden: jnp.ndarray, batch, chunk: int, logits_of) -> dict:
    """`loss_terms` without the full logits: the slots of `hidden` [B, T, E] (final hidden states)
    are taken `chunk` at a time, `logits_of(h)` [B, chunk, V] forms one chunk's logits, and the
    sums are accumulated in a scan whose body is rematerialised, so neither the forward nor the
    backward pass holds logits of more than one chunk (the backward recomputes them: one more head
    matmul). Equal to `loss_terms(logits_of(hidden), batch)` in value and gradient up to float
    summation order. `chunk` must divide T."""
    b, t = hidden.shape[0], hidden.shape[1]
    if batch["targets"].shape != (b, t):
        raise ValueError(f"hidden {hidden.shape} does not match the arrangement "
                         f"{batch['targets'].shape} (expected [B, T, E] with T the slots)")
    if chunk < 1 or t % chunk:
        raise ValueError(f"loss chunk {chunk} must be >= 1 and divide the {t} slots of a row")
    n = t // chunk
    split = lambda x: jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), 1, 0)
    xs = (split(hidden), {k: split(batch[k]) for k in LOSS_KEYS})

    @jax.checkpoint
    def body(acc, x):
        terms = loss_terms(logits_of(x[0]), x[1])
        return {k: acc[k] + terms[k] for k in TERM_KEYS}, None

    zeros = {k: jnp.zeros((), jnp.float32) for k in TERM_KEYS}
    terms, _ = jax.lax.scan(body, zeros, xs)
    return terms


def weight_totals(batch) -> dict:
    """The loss denominators of a (global) batch, from the arrangement alone (no logits):
    {'mlm_weight': sum of MLM weights, 'ar_count': sum of AR weights}."""
    return {"mlm_weight": jnp.sum(batch["mlm_weight"].astype(jnp.float32)),
            "ar_count": jnp.sum(batch["ar_weight"].astype(jnp.float32))}


def _safe_mean(total, denominator):
    ok = denominator > 0
    return jnp.where(ok, total / jnp.where(ok, denominator, 1.0), 0.0)


def combine(terms: dict, ar_weight: float = 1.0, *, objective: str = "dual",
            totals: dict | None = None):
    """(loss, metrics) from `loss_terms` sums. `ar_weight` is w >= 0 (a Python number);
    `objective` one of "dual" ((mlm + w*ar)/(1+w)), "plain" (mlm), "ar" (ar). `totals` (from
    `weight_totals`) overrides the denominators, for gradient accumulation. Metrics: loss,
    mlm_loss, ar_loss, masked_accuracy, masked_count, ar_accuracy."""
    validate_options(objective=objective, ar_weight=ar_weight, mask_token_id=0)
    den = totals if totals is not None else terms
    mlm = _safe_mean(terms["mlm_sum"], den["mlm_weight"])
    ar = _safe_mean(terms["ar_sum"], den["ar_count"])
    if objective == "dual":
        loss = (mlm + ar_weight * ar) / (1.0 + ar_weight)
    elif objective == "plain":
        loss = mlm
    else:
        loss = ar
    metrics = {
        "loss": loss,
        "mlm_loss": mlm,
        "ar_loss": ar,
        "masked_accuracy": _safe_mean(terms["masked_correct"], terms["masked_count"]),
        "masked_count": terms["masked_count"],
        "ar_accuracy": _safe_mean(terms["ar_correct"], terms["ar_count"]),
    }
    return loss, metrics


__all__ = ["OBJECTIVES", "TERM_KEYS", "loss_terms", "chunked_loss_terms", "weight_totals", "combine"]
