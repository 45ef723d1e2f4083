"""The decode step serving LoRA adapters against the base alone: 8 slots of the demo model, the
slots spread over 4 different adapters, beside the same Decoder with every slot on the base and
a Decoder built without adapters.

    python -m benchmarks.decoding.lora_step [--rank 16] [--rounds 4] [--chunks 3] [--method streaming]
        [--out benchmarks/results/lora_step.json]

Adapters: 4 random PEFT folders of `rank` on all seven projections (written to a temporary
folder, loaded by name as a server loads them). Each Decoder: `--method` (window 8, refill
before), 8 slots, the dense cache, float32; counting prompts with long budgets. Timing: per round,
`chunks` `generate` calls of 8 steps for each variant in turn (interleaved); ms per step is the
median over all chunks. Also XLA's cost analysis of each compiled `generate` (bytes accessed and
FLOPs; the loop body counted once). Prints and writes the table as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from benchmarks import results_file

VARIANTS = ("no adapters", "adapters, all slots on the base", "4 adapters over 8 slots")


def random_peft(config, rank: int, seed: int, folder: str) -> str:
    import jax
    import numpy as np

    from wedlm_jax.lora import apply as lora_lib
    from wedlm_jax.lora.spec import LoraSpec
    from wedlm_jax.lora.peft import save_peft
    spec = LoraSpec(rank=rank, alpha=float(rank), targets=("all-linear",))
    rng = np.random.default_rng(seed)
    tree = jax.tree.map(lambda s: (0.05 * rng.standard_normal(s.shape)).astype(np.float32),
                        lora_lib.adapter_shapes(config, spec))
    return str(save_peft(config, tree, spec, f"{folder}/a{seed}"))


def fill(dec, tok, rows):
    from decode.engine.step.state import Request
    st = dec.init_state()
    for b, row in enumerate(rows):
        prompt = tuple(tok.encode(f"Count by {b + 2} from {100 * b + 7} to 9000:\n"))
        st = dec.insert(dec.prefill(Request(prompt=prompt, max_new_tokens=440, tau=0.0,
                                            adapter=row)), st, b)
    return st


def cost(dec) -> dict:
    c = dec.compile("generate").cost_analysis()
    c = c[0] if isinstance(c, list) else c
    return {"bytes": float(c.get("bytes accessed", 0.0)), "flops": float(c.get("flops", 0.0))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decoding.lora_step",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--method", default="streaming", choices=("streaming", "ar"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from benchmarks.decoders import decoder
    from decode.lora_options import LoraOptions
    from demo.eval import load_model
    config, params, tok = load_model(check=False)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    lora = LoraOptions(enable_lora=True, max_loras=4, max_lora_rank=a.rank)
    decs = {}
    for name, opts in zip(VARIANTS, (None, lora, lora)):
        decs[name] = decoder(params, config, method=a.method, window=8, slots=8, capacity=512,
                             steps_per_call=8, sampling=False, page_size=0,
                             **({"lora": opts} if opts else {}))
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(4):
            decs[VARIANTS[2]].adapters.load(f"a{i}", random_peft(config, a.rank, i + 1, tmp))
    rows = {VARIANTS[0]: [0] * 8, VARIANTS[1]: [0] * 8, VARIANTS[2]: [1, 2, 3, 4] * 2}
    states = {n: fill(d, tok, rows[n]) for n, d in decs.items()}
    for n, d in decs.items():
        states[n], _ = d.generate(states[n])                        # the compile
    times = {n: [] for n in decs}
    for _ in range(a.rounds):
        for n, d in decs.items():
            for _ in range(a.chunks):
                t0 = time.perf_counter()
                states[n], res = d.generate(states[n])
                jax.block_until_ready(states[n].done)
                times[n].append((time.perf_counter() - t0) / max(res.steps, 1) * 1e3)
    base = statistics.median(times[VARIANTS[0]])
    out = {"method": a.method, "rank": a.rank, "slots": 8, "rows": rows[VARIANTS[2]], "variants": {}}
    for n, d in decs.items():
        ms = statistics.median(times[n])
        out["variants"][n] = {"ms_per_step": round(ms, 3), "vs_no_adapters": round(ms / base, 3),
                              **cost(d)}
    for n, v in out["variants"].items():
        print(f"{n:<34} {v['ms_per_step']:8.2f} ms/step  x{v['vs_no_adapters']:.3f}  "
              f"{v['bytes'] / 2**20:8.1f} MiB accessed  {v['flops'] / 1e9:7.2f} GFLOP")
    return results_file.write(a.out, out)


if __name__ == "__main__":
    main()
