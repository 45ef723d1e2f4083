"""The int8 KV cache against the float one on the demo model, per compute dtype: greedy AR tokens
(the common prefix of a 48-token continuation), the mean KL per token, the cache's bytes and the
milliseconds per AR step on this machine (a CPU here: XLA:CPU, no target).

    python -m benchmarks.quantized.kv_int8 [--dtypes float32,bfloat16] [--tokens 48] [--slots 4]
                                 [--chunks 4] [--out FILE]

For each dtype: the static batch (`generate`) of five held-out prompts (one per regime) with
`Placement(dtype=d)` and `Placement(dtype=d, kv_dtype="int8")`; the KL is teacher-forced on the
float cache's tokens, one cache-mode forward per row (each row's K/V quantized as decoding writes
them); the step time is `benchmarks.quantized.quantize.step_ms` with the cache's setting.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.probes import host_facts
from benchmarks import results_file

REGIMES = ("counting", "arith", "lists", "records", "code")


def _prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cache_kl(config, params, prompts, continuations, dtype) -> float:
    """Mean KL(float cache || int8 cache) per continuation token, compute in `dtype`."""
    import jax
    import jax.numpy as jnp

    from wedlm_jax import model as model_lib
    rows = [p + c for p, c in zip(prompts, continuations)]
    width = max(map(len, rows))
    ids = jnp.asarray([r + [0] * (width - len(r)) for r in rows])
    pos = jnp.broadcast_to(jnp.arange(width), ids.shape)
    model = model_lib.Transformer(config, dtype=dtype, attention="tiled")
    cast = jax.tree.map(lambda x: x.astype(dtype), params)

    def logp(cache_dtype):
        cache = model_lib.init_kv_cache(config, len(rows), width, cache_dtype)
        out, _ = model.apply({"params": cast}, ids, pos, kv_cache=cache,
                             cache_len=jnp.zeros((len(rows),), jnp.int32))
        return jax.nn.log_softmax(out.astype(jnp.float32))
    a, b = logp(dtype), logp(jnp.int8)
    kl = (jnp.exp(a) * (a - b)).sum(-1)
    return float(jnp.concatenate([kl[i, len(p) - 1:len(r) - 1]
                                  for i, (p, r) in enumerate(zip(prompts, rows))]).mean())


def compare(config, params, prompts, dtype: str, tokens: int) -> dict:
    """Greedy AR with the float and the int8 cache in `dtype`: common prefixes and mean KL."""
    import jax.numpy as jnp

    from decode.config import DecodeConfig, Placement
    from decode.static.static_batch import generate
    dc = DecodeConfig(method="ar", max_new_tokens=tokens)
    base = generate(params, config, prompts, dc, placement=Placement(dtype=dtype)).tokens
    out = generate(params, config, prompts, dc,
                   placement=Placement(dtype=dtype, kv_dtype="int8")).tokens
    shared = [_prefix(a, b) / tokens for a, b in zip(base, out)]
    return dict(dtype=dtype, common_prefix=shared, mean_common_prefix=sum(shared) / len(shared),
                mean_kl_per_token=cache_kl(config, params, prompts, base, jnp.dtype(dtype)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quantized.kv_int8",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--out", default=None, help="also write the results here (JSON)")
    a = ap.parse_args(argv)
    from benchmarks.quantized.quantize import load, step_ms
    from demo.eval import DEMO_MODEL, eval_items, load_model
    from wedlm_jax.attention.kv_quant import row_bytes
    config, params, counting = load("demo")
    tok = load_model(DEMO_MODEL, check=False)[2]
    prompts = [tok.encode(eval_items(DEMO_MODEL, k, 2)[1]["prompt"]) for k in REGIMES]
    rows = []
    for dtype in a.dtypes.split(","):
        row = compare(config, params, prompts, dtype, a.tokens)
        for kv in ("auto", "int8"):
            r = step_ms(config, params, counting, dtype, "none", a.slots, a.chunks, kv)
            row[f"ms_per_step_{kv}"] = r["ms_per_step"]
        row["step_int8_vs_float"] = round(row["ms_per_step_int8"] / row["ms_per_step_auto"], 3)
        row["cache_bytes_int8_vs_float"] = round(row_bytes(config.head_dim, "int8")
                                                 / row_bytes(config.head_dim, dtype), 4)
        rows.append(row)
        print(json.dumps(row))
    out = dict(model="demo", method="ar", tokens=a.tokens, prompts=list(REGIMES), slots=a.slots,
               **host_facts(), results=rows)
    return results_file.write(a.out, out)


if __name__ == "__main__":
    main()
