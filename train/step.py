"""The optimizer, the learning-rate schedule and the one jitted, sharded train step.

    opt = make_optimizer(cfg)                                   # optax AdamW (+ clip)
    shard = state_shardings(model_cfg, opt, mesh)               # {'params', 'opt_state', 'step'}
    step_fn = make_train_step(cfg, model_cfg, opt, mesh, shard, mask_token_id)
    state, metrics = step_fn(state, batch)                      # state donated

The state is `{'params': f32 master weights, 'opt_state': optax state, 'step': int32}`; a batch is
`{'tokens', 'segment_ids', 'maskable': [B, L], 'index': int32 [B] global example indices}` sharded
over the batch mesh axes ('data', 'fsdp').

Inside the step, on device: per-row PRNG keys from (seed, step, global example index)
(`masking.row_keys`, so the result does not depend on how many devices or hosts there are), the
arrangement of the objective, the loss denominators of the whole global batch
(`losses.weight_totals`), then `grad_accum` microbatches in a `lax.scan`, each contributing its sums
over those global denominators, so the accumulated loss and gradient equal those of one big batch.
The model computes in `compute_dtype` (bf16 or f32) from the f32 master weights, with the
attention implementation of `cfg.attention` fed the arrangement's structure (`auto`: the tiled,
tile-skipping kernel on CPU/GPU, splash on TPU; `dense` materialises the [T, T] mask).

Weight decay: on every matrix (projections, and the embedding / LM head unless
`optimizer.decay_embeddings=false`); never on norms' scales or biases.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from train import lora as lora_train
from train.config import TrainConfig, compute_dtype
from wedlm_jax.dtypes import dtype_name
from wedlm_jax.attention import backends as attn_backends
from wedlm_jax.lora import apply as lora_lib
from wedlm_jax import losses, masking
from wedlm_jax import model as model_lib
from wedlm_jax.config import ModelConfig
from wedlm_jax.axis_rules import DEFAULT_RULES
from wedlm_jax.sharding import tree_shardings

OBJECTIVE_NAMES = {"dual_stream": "dual", "plain": "plain", "ar_only": "ar"}
BATCH_AXES = ("data", "fsdp")
BATCH_KEYS = ("tokens", "segment_ids", "maskable", "index")


# ------------------------------------------------------------------------- optimizer, schedule

def lr_schedule(cfg: TrainConfig):
    """Linear warmup (step i < warmup uses lr * (i+1) / warmup), then cosine from `lr` at step
    `warmup` to `final_lr` at step `steps` (constant after). Steps count from 0."""
    o = cfg.optimizer
    warm, total = cfg.warmup, cfg.steps
    peak, final = o.lr, o.final_lr

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        w = jnp.minimum((step + 1) / max(warm, 1), 1.0) * peak
        frac = jnp.clip((step - warm) / max(total - warm, 1), 0.0, 1.0)
        c = final + 0.5 * (peak - final) * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(step < warm, w, c)
    return schedule


def decay_mask(params, decay_embeddings: bool = True):
    """True for parameters that get weight decay: matrices (kernels, and embedding / lm_head when
    `decay_embeddings`), never norm scales or biases."""
    def leaf(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        if name in ("scale", "bias"):
            return False
        if name in ("embedding", "lm_head"):
            return decay_embeddings
        return True
    return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    o = cfg.optimizer
    adamw = optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mu_dtype=dtype_name(o.mu_dtype) if o.mu_dtype else None,
                        mask=functools.partial(decay_mask, decay_embeddings=o.decay_embeddings))
    if o.clip > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip), adamw)
    return adamw


# ------------------------------------------------------------------------------- state, sharding

def state_shardings(model_cfg: ModelConfig, opt: optax.GradientTransformation, mesh,
                    rules=DEFAULT_RULES, lora=None) -> dict:
    """NamedShardings of the train state: params from the logical axes table; optimizer moments
    like their params; scalars (step, counts) replicated. `lora`: a LoraSpec (train/lora.py),
    whose adapters are then the state's params."""
    shapes, axes = lora_train.trainable_trees(model_cfg, lora)
    params = tree_shardings(axes, shapes, mesh, rules)
    replicated = NamedSharding(mesh, P())
    opt_shapes = jax.eval_shape(opt.init, shapes)
    opt_sh = optax.tree_utils.tree_map_params(
        opt, lambda _, s: s, opt_shapes, params,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding))
    return {"params": params, "opt_state": opt_sh, "step": replicated}


def state_shapes(model_cfg: ModelConfig, opt, shardings: dict, lora=None) -> dict:
    """Abstract state (ShapeDtypeStructs with shardings), e.g. as an Orbax restore target."""
    shapes = lora_train.trainable_trees(model_cfg, lora)[0]
    tree = {"params": shapes, "opt_state": jax.eval_shape(opt.init, shapes),
            "step": jax.ShapeDtypeStruct((), jnp.int32)}
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        tree, shardings)


def init_state(params, opt, shardings: dict) -> dict:
    """Train state from params (already placed or host arrays): step 0, fresh optimizer state."""
    params = jax.tree.map(lambda p, s: jax.device_put(jnp.asarray(p, jnp.float32), s), params,
                          shardings["params"])
    opt_state = jax.jit(opt.init, out_shardings=shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    return {"params": params, "opt_state": opt_state, "step": step}


def init_params_sharded(model_cfg: ModelConfig, seed: int, shardings: dict):
    """Random f32 params created directly in their shardings (from-scratch training)."""
    fn = jax.jit(lambda: model_lib.init_params(model_cfg, jax.random.key(seed)),
                 out_shardings=shardings["params"])
    return fn()


def batch_shardings(mesh) -> dict:
    rows = NamedSharding(mesh, P(BATCH_AXES))
    rows2 = NamedSharding(mesh, P(BATCH_AXES, None))
    return {"tokens": rows2, "segment_ids": rows2, "maskable": rows2, "index": rows}


# ------------------------------------------------------------------------------------ the step

def _split_micro(x, n):
    """[B, ...] -> [n, B/n, ...]; microbatch a holds rows a, a+n, a+2n, ... (every device keeps
    an equal share of each microbatch under a contiguous batch sharding)."""
    b = x.shape[0]
    return jnp.swapaxes(x.reshape((b // n, n) + x.shape[1:]), 0, 1)


def make_loss_fn(cfg: TrainConfig, model_cfg: ModelConfig, platform: str | None = None,
                 scan_unroll: int = 1):
    """f(params, arrangement, totals) -> (loss over the global denominators, loss_terms).
    `platform`: the target the attention implementation is resolved for (default: jax's default
    backend; the dry run compiles for a described topology)."""
    model = model_lib.Transformer(model_cfg, dtype=compute_dtype(cfg), param_dtype=jnp.float32,
                                  remat=cfg.remat, attention=attention_impl(cfg, platform),
                                  platform=platform,
                                  attention_tile=cfg.attention_tile,
                                  attention_block_size=cfg.objective.block_size,
                                  scan_unroll=scan_unroll)
    if (spec := lora_train.spec_of(cfg)) is not None:
        model = lora_lib.lora_model(model, spec)
    objective = OBJECTIVE_NAMES[cfg.objective.kind]
    w = float(cfg.objective.ar_weight)

    def loss_fn(params, arr, totals, frozen=None):
        """`frozen`: LoRA's (base, dropout key); `params` are then the adapters."""
        variables, rngs = ({"params": params}, None) if frozen is None else \
            lora_train.forward_variables(params, frozen, model.dtype)
        structure = {k: arr[k] for k in masking.STRUCTURE_KEYS}
        if cfg.loss_chunk:
            hidden, head = model.apply(variables, arr["tokens"], arr["positions"], rngs=rngs,
                                       structure=structure, objective=objective, return_hidden=True)
            terms = losses.chunked_loss_terms(
                hidden, arr, cfg.loss_chunk, lambda h: model_lib.head_logits(h, head, model.dtype))
        else:
            logits = model.apply(variables, arr["tokens"], arr["positions"], rngs=rngs,
                                 structure=structure, objective=objective)
            terms = losses.loss_terms(logits, arr)
        loss, _ = losses.combine(terms, w, objective=objective, totals=totals)
        return loss, terms
    return loss_fn


def attention_impl(cfg: TrainConfig, backend: str | None = None) -> str:
    """The attention implementation the step will use (raises `AttentionUnavailable`, a
    ConfigError naming the backend, when `cfg.attention` cannot run here)."""
    return attn_backends.resolve(cfg.attention, "structure", backend=backend,
                                 dtype=compute_dtype(cfg))


def make_step_fn(cfg: TrainConfig, model_cfg: ModelConfig, opt, mask_token_id: int | None,
                 platform: str | None = None, scan_unroll: int = 1):
    """The un-jitted step(state, batch) -> (state, metrics)."""
    objective = OBJECTIVE_NAMES[cfg.objective.kind]
    ob = cfg.objective
    accum = cfg.optimizer.grad_accum
    w = float(ob.ar_weight)
    loss_fn = make_loss_fn(cfg, model_cfg, platform, scan_unroll)
    grad_fn = jax.grad(loss_fn, has_aux=True)
    schedule = lr_schedule(cfg)

    def step(state, batch, base=None):
        params = state["params"]
        key = lora_train.dropout_key(cfg, state["step"]) if base is not None else None
        keys = masking.row_keys(cfg.seed, state["step"], batch["index"])
        arr = masking.arrange_rows(
            objective, keys, batch["tokens"], batch["segment_ids"], batch["maskable"],
            block_size=ob.block_size, mask_token_id=mask_token_id if objective != "ar" else None,
            mask_per_block=ob.mask_per_block, eps=ob.eps)
        arr = {k: v for k, v in arr.items() if k != "source"}
        totals = losses.weight_totals(arr)
        micro = jax.tree.map(lambda x: _split_micro(x, accum), arr)
        micro = jax.lax.with_sharding_constraint(
            micro, jax.tree.map(lambda x: P(None, BATCH_AXES, *([None] * (x.ndim - 2))), micro))

        def body(carry, xs):
            (g_acc, t_acc), (mb, i) = carry, xs
            g, terms = grad_fn(params, mb, totals, frozen(i))
            return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, t_acc, terms)), None

        zeros_g = jax.tree.map(jnp.zeros_like, params)
        zeros_t = {k: jnp.zeros((), jnp.float32) for k in losses.TERM_KEYS}
        frozen = lambda i: None if base is None else (  # noqa: E731 (LoRA: base, dropout key)
            base, None if key is None else jax.random.fold_in(key, i))
        if accum == 1:
            grads, terms = grad_fn(params, jax.tree.map(lambda x: x[0], micro), totals, frozen(0))
        else:
            (grads, terms), _ = jax.lax.scan(body, (zeros_g, zeros_t), (micro, jnp.arange(accum)))
        loss, metrics = losses.combine(terms, w, objective=objective)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = opt.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        metrics = dict(metrics, grad_norm=grad_norm, lr=schedule(state["step"]),
                       tokens=jnp.sum((batch["segment_ids"] != 0).astype(jnp.float32)))
        if cfg.nonfinite_skips:     # a non-finite step leaves the weights and moments as they were
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
            new_params, opt_state = keep(new_params, params), keep(opt_state, state["opt_state"])
            metrics["skipped_update"] = 1.0 - ok.astype(jnp.float32)
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, metrics

    return step


def make_train_step(cfg: TrainConfig, model_cfg: ModelConfig, opt, mesh, shardings: dict,
                    mask_token_id: int | None, rules=DEFAULT_RULES, platform: str | None = None,
                    scan_unroll: int = 1, base=None):
    """The jitted step: explicit in/out shardings on the ('data', 'fsdp', 'tensor') mesh, the
    state donated. Call it under `jax.set_mesh(mesh)` (`run_step` does). `platform`: the target
    the attention is resolved for (default: the mesh's devices' platform). `base`: LoRA's frozen
    base (placed arrays or sharded ShapeDtypeStructs), an argument of every call, not donated;
    `run_step.lower(state, batch)` lowers the step either way."""
    platform = platform or mesh.devices.flat[0].platform
    step = make_step_fn(cfg, model_cfg, opt, mask_token_id, platform, scan_unroll)
    replicated = NamedSharding(mesh, P())

    def wrapped(state, batch, *frozen):
        with nn.logical_axis_rules(rules.as_flax_rules()):
            return step(state, batch, *frozen)

    metric_keys = ("loss", "mlm_loss", "ar_loss", "masked_accuracy", "masked_count", "ar_accuracy",
                   "grad_norm", "lr", "tokens") + (("skipped_update",) if cfg.nonfinite_skips else ())
    extra = () if base is None else (base,)
    jitted = jax.jit(wrapped, in_shardings=(shardings, batch_shardings(mesh))
                     + tuple(lora_train.sharding_tree(b) for b in extra),
                     out_shardings=(shardings, {k: replicated for k in metric_keys}),
                     donate_argnums=(0,))

    def run_step(state, batch):
        with jax.set_mesh(mesh):
            return jitted(state, batch, *extra)
    run_step.jitted = jitted
    run_step.lower = lambda state, batch: jitted.lower(state, batch, *extra)
    return run_step


# ------------------------------------------------------------------------------- FLOPs and MFU

def attention_pairs(seq_len: int, objective: str, block_size: int) -> int:
    """(query, key) pairs the attention rules allow for one document filling a row of `seq_len`
    tokens: dual_stream = memory causal L(L+1)/2, plus per block k of n_k slots the k*B clean
    keys of earlier blocks and n_k(n_k+1)/2 causal pairs inside the block (about a quarter of the
    dense (2L)^2); plain / ar_only = L(L+1)/2. Packed rows with several documents have fewer."""
    n = seq_len
    pairs = n * (n + 1) // 2
    if objective != "dual_stream":
        return pairs
    for k, start in enumerate(range(0, n, block_size)):
        nk = min(n, start + block_size) - start
        pairs += nk * start + nk * (nk + 1) // 2
    return pairs


def model_flops_per_row(model_cfg: ModelConfig, seq_len: int, objective: str,
                        block_size: int = 32) -> float:
    """Training FLOPs (forward + backward = 3x forward) of one packed row of `seq_len` tokens: the
    matmuls of every projection and the LM head for each of the T fed slots (T = 2L for
    dual_stream), plus scores and weighted values (4 x q_dim FLOPs per pair) over the pairs the
    attention mask allows (`attention_pairs`; the work an exact kernel cannot skip: a dense kernel
    does ~4x more for dual_stream, uncounted). Remat's recomputation is not counted."""
    c = model_cfg
    t = 2 * seq_len if objective == "dual_stream" else seq_len
    e = c.hidden_size
    per_tok = c.num_layers * (2 * e * (c.q_dim + 2 * c.kv_dim) + 2 * c.q_dim * e
                              + 2 * 3 * e * c.intermediate_size) + 2 * e * c.vocab_size
    return 3.0 * (per_tok * t) + attention_flops_per_row(c, seq_len, objective, block_size)


def attention_flops_per_row(model_cfg: ModelConfig, seq_len: int, objective: str,
                            block_size: int = 32) -> float:
    pairs = attention_pairs(seq_len, objective, block_size)
    return 3.0 * model_cfg.num_layers * 4 * pairs * model_cfg.q_dim


def measure_matmul_flops(n: int = 1024, repeats: int = 5, dtype=jnp.float32, device=None) -> float:
    """Measured FLOP/s of an n x n x n matmul on one device (the best of `repeats`)."""
    import time
    device = device or jax.local_devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    b = jax.device_put(jnp.full((n, n), 0.5, dtype), device)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best
