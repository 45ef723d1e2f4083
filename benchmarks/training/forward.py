"""Forward-pass time: our jitted model vs transformers' forward, same weights and inputs, CPU f32.

    python -m benchmarks.training.forward [--batches 1 8] [--seq 128] [--repeats 20] [--single-thread]

Builds one small random Qwen3 model with transformers, saves it, loads the same folder with
`load_hf_checkpoint`, then for each batch size times (after warm-up) the median of `--repeats`
runs of
  - ours:         jax.jit(Transformer.apply)(params, tokens, positions), block_until_ready
  - transformers: model(input_ids).logits under torch.no_grad() (default attention: sdpa)
side by side (interleaved: one run of each in turn), and prints the ratio ours / transformers (below 1 = ours faster). The logits of
the two are compared too (max abs difference) so the timing is of the same computation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def interleaved_medians(fns, repeats: int, warmup: int = 3) -> list[float]:
    """Median seconds of each fn, timed alternately (fn0, fn1, fn0, ...) so that load from other
    processes on a shared machine falls on all of them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--single-thread", action="store_true",
                    help="one thread each (torch.set_num_threads(1); XLA without its Eigen pool): "
                         "steadier on a shared, oversubscribed machine")
    args = ap.parse_args(argv)
    if args.single_thread:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                   " intra_op_parallelism_threads=1").strip()

    import jax
    import torch
    if args.single_thread:
        torch.set_num_threads(1)

    from benchmarks.synthetic import qwen3_hf_model
    from wedlm_jax import convert, model as model_lib

    hf_model = qwen3_hf_model(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=8,
                              kv_heads=4, head_dim=args.hidden // 8, intermediate=4 * args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        config, params = convert.load_hf_checkpoint(tmp, progress=False)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    net = model_lib.Transformer(config)
    forward = jax.jit(lambda p, t, pos: net.apply({"params": p}, t, pos))

    print(f"model: Qwen3-shaped, hidden {args.hidden}, {args.layers} layers, 8 heads / 4 kv heads, "
          f"vocab {args.vocab}, {n_params / 1e6:.1f} M params, f32; seq {args.seq}; "
          f"median of {args.repeats} interleaved runs after 3 warm-up runs; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}, "
          f"{'1 thread' if args.single_thread else 'default threads'}), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads, attn {hf_model.config._attn_implementation}), "
          f"{os.cpu_count()} CPU cores")
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batches:
        tokens = rng.integers(0, args.vocab, (b, args.seq)).astype(np.int32)
        positions = np.broadcast_to(np.arange(args.seq, dtype=np.int32), (b, args.seq))
        ids = torch.as_tensor(tokens, dtype=torch.long)

        def run_jax():
            return forward(params, tokens, positions).block_until_ready()

        def run_torch():
            with torch.no_grad():
                return hf_model(ids).logits

        diff = float(np.abs(np.asarray(run_jax()) - run_torch().numpy()).max())
        t_jax, t_torch = interleaved_medians([run_jax, run_torch], args.repeats)
        print(f"B={b:<2d} S={args.seq}: ours (jit) {t_jax * 1e3:8.2f} ms | transformers "
              f"{t_torch * 1e3:8.2f} ms | ratio ours/transformers {t_jax / t_torch:5.2f} | "
              f"max |logit diff| {diff:.1e}")
        rows.append(dict(batch=b, seq=args.seq, ours_s=t_jax, transformers_s=t_torch,
                         max_logit_diff=diff))
    return rows


if __name__ == "__main__":
    main()
