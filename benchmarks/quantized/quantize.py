"""Milliseconds per AR decode step with quantized weights against float32 and bfloat16, side by
side, on this machine's default device (a CPU here: XLA:CPU, no target).

    python -m benchmarks.quantized.quantize [--model demo|wide|DIR] [--slots 4] [--chunks 8] [--out FILE]

Each regime (`REGIMES`: dtype x weight quantization) builds the Decoder a door would (a plan from
`Placement(dtype=..., quantize=...)`, the dense cache), inserts `slots` counting prompts with long
budgets, compiles on one chunk, then times `chunks` `generate` calls of 8 steps; the median
milliseconds per step and the bytes of the weights as the Decoder holds them are reported.
Models: the shipped demo model ("demo", 25 MB of float32 weights), or a random Qwen3-shaped
"wide" one (`WIDE`, ~0.45 GB in float32) where the weights' bytes dominate a step.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.probes import host_facts
import statistics
import time

REGIMES = (("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8"),
           ("float32", "int4"), ("bfloat16", "int4"))
WIDE = dict(model_type="qwen3", vocab_size=4096, hidden_size=1024, intermediate_size=3072,
            num_layers=8, num_heads=16, num_kv_heads=8, head_dim=64, qk_norm=True,
            mask_token_id=4095, max_position_embeddings=4096)


def load(model: str):
    """(config, float32 params, prompts as token lists) of the model named."""
    if model == "wide":
        from wedlm_jax.config import ModelConfig
        from wedlm_jax.model import random_params
        config = ModelConfig(**WIDE)
        return config, random_params(config), [[7 + 13 * b + i for i in range(24)]
                                               for b in range(64)]
    from demo.eval import DEMO_MODEL, load_model
    config, params, tok = load_model(DEMO_MODEL if model == "demo" else model)
    return config, params, [tok.encode(f"Count by {b + 2} from {100 * b + 7} to 9000:\n")
                            for b in range(64)]


def step_ms(config, params, prompts, dtype: str, quantize: str, slots: int, chunks: int,
            kv_dtype: str = "auto") -> dict:
    """One regime's median milliseconds per step and its weights' bytes (`kv_dtype`: the
    cache's, Placement's)."""
    import jax
    from decode.config import EngineOptions, Placement
    from decode.engine.runtime.decoder import Decoder
    from decode.engine.step.state import Request
    from decode.engine.planning.plan import make_plan
    from wedlm_jax.quantize import weight_bytes
    plan = make_plan(config, EngineOptions(method="ar", slots=slots, capacity=1024,
                                           steps_per_call=8),
                     Placement(dtype=dtype, quantize=quantize, page_size=0, kv_dtype=kv_dtype),
                     sampling=False)
    cast = jax.tree.map(lambda x: x.astype(dtype), params)
    dec = Decoder(cast, plan)
    del cast
    st = dec.init_state()
    for b in range(slots):
        req = Request(prompt=tuple(prompts[b]), max_new_tokens=900, tau=0.0)
        st = dec.insert(dec.prefill(req), st, b)
    st, _ = dec.generate(st)            # the compile
    times = []
    for _ in range(chunks):
        t0 = time.perf_counter()
        st, res = dec.generate(st)
        jax.block_until_ready(st.done)
        times.append((time.perf_counter() - t0) / max(res.steps, 1) * 1e3)
    return dict(dtype=dtype, quantize=quantize, group=dec.static.quantize_group, kv_dtype=kv_dtype,
                ms_per_step=round(statistics.median(times), 3),
                weight_bytes=weight_bytes(dec.params))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quantized.quantize",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="demo | wide | a checkpoint folder")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--regimes", default=None,
                    help="comma-separated dtype:scheme (default: every one of REGIMES)")
    ap.add_argument("--out", default=None, help="also write the results here (JSON)")
    a = ap.parse_args(argv)
    regimes = REGIMES if a.regimes is None else [tuple(r.split(":")) for r in a.regimes.split(",")]
    config, params, prompts = load(a.model)
    rows = [step_ms(config, params, prompts, d, q, a.slots, a.chunks) for d, q in regimes]
    base = next((r["ms_per_step"] for r in rows if (r["dtype"], r["quantize"]) == ("float32", "none")),
                None)
    for r in rows:
        r["vs_float32"] = round(r["ms_per_step"] / base, 3) if base else None
        print(f"{r['dtype']:<9} {r['quantize']:<5} {r['ms_per_step']:>9.2f} ms/step "
              f"{r['weight_bytes'] / 2**20:>8.1f} MiB weights"
              + (f"  {r['vs_float32']:.2f}x float32" if base else ""))
    out = dict(model=a.model, method="ar", slots=a.slots, chunks=a.chunks, steps_per_call=8,
               **host_facts(), results=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
