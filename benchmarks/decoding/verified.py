"""Verified streaming beside plain streaming and AR, same weights, one run, this machine.

    python -m benchmarks.decoding.verified [--quick] [--repeats 3] [--train-steps 500] [--json out.json]

For each regime and tau: tokens per forward (N_gen / forward steps), p_cache, accepted / rejected
drafts, wall time (median of interleaved repeats, compile excluded), the speed-up over AR (AR wall /
method wall) and whether the output equals AR greedy's token for token. W = 16, lambda = 0.05.

The regimes are synthetic, mechanics on weights whose agreement is set by hand (the trained demo
model's regimes: `python -m benchmarks.demo_model.demo_experiments verified`):
  counting  a tiny model (vocab 64, hidden 64, 2 layers) trained here for --train-steps steps of the
            dual-stream objective (block 32, Adam 3e-3, batch 32 x 64 tokens) on "count up by one
            mod 63, with a random jump at 5% of the positions"; 8 prompts of 8 counting tokens, 56 new
            tokens each (inside the trained length), one batch;
  plain     random N(0, 0.02) weights, LM head x20 (vocab 2048, hidden 256, 4 layers): the mask and
            AR readings rarely agree (drafts are wrong); one 64-token prompt, 256 new tokens;
  agree     the same shape with attention nearly uniform (q/k norm scales x0.1), value/output
            projections x20, LM head x100: each slot is mostly an average of its context, the two
            readings see almost the same context and agree; its greedy output collapses to one
            repeated token, the most parallel case there is.
The random regimes' outputs are not text; they show mechanics (what verification costs and
keeps), not what a trained WeDLM gains.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.synthetic import random_params as make_params
from decode.config import DecodeConfig
from decode.static.static_batch import generate
from wedlm_jax.config import ModelConfig

SMALL = ModelConfig(model_type="qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768,
                    num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True,
                    mask_token_id=2047)
REGIMES = {"plain": dict(head_scale=20.0), "agree": dict(head_scale=100.0, qk_scale=0.1, vo_scale=20.0)}

COUNT = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                    mask_token_id=63)


def counting_batch(rng, batch, length, jump=0.05):
    """Rows counting up by one mod 63 (ids 0..62; 63 is [MASK]) from a random start, with a random
    jump at a `jump` fraction of the positions."""
    v = COUNT.vocab_size - 1
    steps = np.where(rng.random((batch, length)) < jump, rng.integers(0, v, (batch, length)), 1)
    steps[:, 0] = rng.integers(0, v, batch)
    return (np.cumsum(steps, axis=1) % v).astype(np.int32)


def train_counting(steps, seed=0, batch=32, length=64):
    """Train COUNT with the dual-stream objective (wedlm_jax.masking + wedlm_jax.losses); returns
    (params, last loss, last masked accuracy, seconds)."""
    import optax
    from wedlm_jax import losses, masking
    from wedlm_jax.model import Transformer

    model = Transformer(COUNT)
    params = make_params(COUNT, seed, 1.0)
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)
    seg = jnp.ones((batch, length), jnp.int32)
    maskable = jnp.ones((batch, length), bool)

    @jax.jit
    def step(params, opt_state, tokens, key):
        arr = masking.arrange_rows("dual", jax.random.split(key, batch), tokens, seg, maskable,
                                   block_size=32, mask_token_id=COUNT.mask_token_id)

        def loss_fn(p):
            logits = model.apply({"params": p}, arr["tokens"], arr["positions"], structure=arr,
                                 objective="dual")
            return losses.combine(losses.loss_terms(logits, arr))
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for i in range(steps):
        params, opt_state, loss, metrics = step(params, opt_state, counting_batch(rng, batch, length),
                                                jax.random.key(i))
    return params, float(loss), float(metrics["masked_accuracy"]), time.perf_counter() - t0


def measure(config, params, prompts, dcs, repeats, capacity):
    """Compile each, then `repeats` interleaved timed runs; per method the median wall and the
    last result."""
    for dc in dcs.values():
        generate(params, config, prompts, dc, capacity=capacity)
    walls, last = {m: [] for m in dcs}, {}
    for _ in range(repeats):
        for m, dc in dcs.items():
            last[m] = generate(params, config, prompts, dc, capacity=capacity)
            walls[m].append(last[m].wall_s)
    return {m: statistics.median(w) for m, w in walls.items()}, last


def regime_rows(config, params, prompts, new, capacity, taus, window, repeats):
    rows = {}
    for tau in taus:
        dcs = {m: DecodeConfig(method=m, window=window, tau=tau, lam=0.05, max_new_tokens=new)
               for m in ("ar", "streaming", "verified")}
        wall, res = measure(config, params, prompts, dcs, repeats, capacity)
        ar_tokens = res["ar"].tokens
        row = {}
        for m, r in res.items():
            flat = [(a == b) for x, y in zip(r.tokens, ar_tokens) for a, b in zip(x, y)]
            row[m] = dict(wall_s=wall[m], speedup_over_ar=wall["ar"] / wall[m], steps=r.steps,
                          loop_iterations=r.loop_iterations, n_gen=r.n_gen,
                          tokens_per_forward=r.tokens_per_forward, p_cache=r.p_cache,
                          accepted=r.accepted, rejected=r.rejected,
                          accepted_per_step=r.accepted / r.steps, rejected_per_step=r.rejected / r.steps,
                          equals_ar=r.tokens == ar_tokens, same_as_ar_fraction=sum(flat) / len(flat))
        rows[str(tau)] = row
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test of the script)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--train-steps", type=int, default=500)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = dict(machine=f"{platform.machine()} {os.cpu_count()} CPU cores, jax {jax.__version__} "
                       f"{jax.devices()[0].platform}", window=args.window, lam=0.05,
               repeats=args.repeats, regimes={})
    t0 = time.perf_counter()
    params, loss, acc, secs = train_counting(20 if args.quick else args.train_steps)
    prompts = [[(s + i) % 63 for i in range(8)] for s in (0, 5, 17, 23, 31, 40, 50, 58)]
    out["counting_training"] = dict(steps=20 if args.quick else args.train_steps, final_loss=loss,
                                    masked_accuracy=acc, seconds=secs)
    out["regimes"]["counting"] = regime_rows(COUNT, params, prompts, 24 if args.quick else 56, 64,
                                             (0.4, 1.0, 2.0), args.window, args.repeats)
    print(f"# counting: {time.perf_counter() - t0:.0f} s", flush=True)
    prompt = [np.random.default_rng(4).integers(0, 2000, 64).tolist()]
    for regime, kw in REGIMES.items():
        t0 = time.perf_counter()
        out["regimes"][regime] = regime_rows(SMALL, make_params(SMALL, 0, **kw), prompt,
                                             48 if args.quick else 256, 512, (0.4, 2.0),
                                             args.window, args.repeats)
        print(f"# {regime}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    print("\n| regime | tau | method | tokens/forward | p_cache | accepted/step | rejected/step | "
          "wall s | x AR | = AR |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for regime, rows in out["regimes"].items():
        for tau, row in rows.items():
            for m, r in row.items():
                same = "yes" if r["equals_ar"] else "no ({:.0%} same)".format(r["same_as_ar_fraction"])
                print(f"| {regime} | {tau} | {m} | {r['tokens_per_forward']:.2f} | {r['p_cache']:.3f} | "
                      f"{r['accepted_per_step']:.2f} | {r['rejected_per_step']:.2f} | {r['wall_s']:.3f} | "
                      f"{r['speedup_over_ar']:.2f} | {same} |")


if __name__ == "__main__":
    main()
