"""The admission as served, on a card (`python -m benchmarks.gpu.on_gpu --parts admit`): time to first
token of one 2K prompt and of 8 at once, and the prefill's MFU.

A Decoder over random bf16 weights of the Qwen3-8B shape, built as `benchmarks.gpu.on_gpu`'s step
settings build theirs (`served_decoder`: the server's cache and kernel, 8 slots, capacity =
live rows + CAPACITY_HEADROOM), streaming W16 with the refill after (so its `generate` is the
compiled program of the "streaming W16 after b8" setting). Cases, one warm-up round (the
compiles), then interleaved rounds, medians:

  1 prompt              one request of `live` random tokens admitted into a free slot as the
                        Batcher admits it (dense cache: `prefill` + `insert`; paged:
                        `prefill_into_slot` into its pages), then one `generate` call, which ends
                        at the request's first tokens
  8 prompts             eight such requests admitted one after another, then one `generate` call
                        giving each its first tokens
  8 prompts, batched    `Decoder.start`: the eight prompts in one batched prefill (the static-
                        batch path), then one `generate` call

Per case: admission_s (the admissions, the device synchronised after them), ttft_s (from the
first admission to the first tokens on the host: admission + the first call), the steps that
call ran, and the MFU of the admission: model FLOPs (`prefill_flops`) / admission_s / the card's
bf16 rate (the measured matmul rate when the probes part ran, else the nominal peak; the row says
which). The slots are freed after each round (dense: `free`; paged: `unmap`).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

CAPACITY_HEADROOM = 512        # cache rows past the live ones: a timed run's tokens, and more
SMOKE_HEADROOM = 96
ADMIT_SETTING = dict(method="streaming", window=16, refill="after", slots=8)


def capacity_for(live: int, smoke: bool) -> int:
    return live + (SMOKE_HEADROOM if smoke else CAPACITY_HEADROOM)


def served_decoder(params, config, *, method: str, window: int, refill: str, slots: int,
                   capacity: int, page_size=None, attention: str = "auto",
                   quantize: str = "none", quantize_group: int | None = None):
    """A Decoder as the card's runs build it: as the server builds its own (`page_size` None: the
    server's cache on this platform, paged 64 with the Triton paged kernel on GPU), bf16,
    greedy, 8 steps a call, the last id of the vocabulary as the mask (random weights: any id
    serves), capacity past the model's positions allowed; float weights quantized by the
    Decoder under `quantize`. Equal arguments give equal static
    settings: the compiled programs are shared."""
    from decode.config import EngineOptions, Placement
    from decode.engine.runtime.decoder import Decoder
    from decode.engine.planning.plan import make_plan
    engine = EngineOptions(method=method, window=window, refill=refill, slots=slots,
                           capacity=capacity, steps_per_call=8, allow_long=True)
    placement = Placement(dtype="bfloat16", page_size=page_size, attention=attention,
                          quantize=quantize, quantize_group=quantize_group)
    return Decoder(params, make_plan(config, engine, placement, sampling=False,
                                     mask_token_id=config.vocab_size - 1, continuous=True))


def rows_prefilled(method: str, prompt_len: int) -> int:
    """The prompt rows a prefill computes: AR and verified hold the last prompt token back as
    the pending one (decode.engine.step.state.request_row)."""
    return prompt_len - 1 if method in ("ar", "verified") else prompt_len


def prefill_flops(config, rows: int) -> float:
    """Model FLOPs of a prefill computing `rows` prompt rows: every projection of every layer
    (2 FLOPs a multiply-add: q, k, v, o and the gated MLP) for each row, and the causal
    attention's scores and weighted values, 4 x q_dim FLOPs a (query, key) pair, rows (rows + 1)
    / 2 pairs a layer. No LM head: the prefill keeps no logits. Norms and RoPE not counted."""
    c, e = config, config.hidden_size
    per_row = c.num_layers * (2 * e * (c.q_dim + 2 * c.kv_dim) + 2 * c.q_dim * e
                              + 2 * 3 * e * c.intermediate_size)
    return float(per_row * rows + c.num_layers * 4 * c.q_dim * rows * (rows + 1) // 2)


def card_rate(info: dict) -> tuple[float | None, str | None]:
    """The bf16 FLOP/s an MFU is taken against: the probes' measured matmul rate, else the
    card's nominal peak (benchmarks.probes.NOMINAL), else None."""
    if info.get("bf16_flops"):
        return info["bf16_flops"], "measured bf16 matmul rate (probes)"
    nominal = info.get("nominal_bf16_flops")
    if nominal is None:
        from benchmarks.probes import device_info
        nominal = device_info().get("nominal_bf16_flops")
    return (nominal, "nominal bf16 peak") if nominal else (None, None)


def _pages(dec, request, slot: int) -> list:
    """A paged Decoder's pages for `request` in `slot`: the slot's own run of the pool."""
    per_seq = dec.static.pages_per_seq
    need = dec.pages_for_call(rows_prefilled(dec.method, len(request.prompt)), dec.end_of(request))
    return list(range(slot * per_seq, slot * per_seq + need))


def admit_served(dec, state, requests):
    """`requests` into slots 0.. one after another as the Batcher admits them, then one
    `generate` call: (state, admission seconds, seconds to the first tokens, result)."""
    import jax
    t0 = time.perf_counter()
    for slot, r in enumerate(requests):
        if dec.paged:
            state = dec.prefill_into_slot(state, r, slot, _pages(dec, r, slot))
        else:
            state = dec.insert(dec.prefill(r), state, slot)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    state, result = dec.generate(state)
    return state, t1 - t0, time.perf_counter() - t0, result


def admit_batched(dec, requests):
    """`Decoder.start` of `requests` (one batched prefill), then one `generate` call."""
    import jax
    t0 = time.perf_counter()
    state = jax.block_until_ready(dec.start(requests))
    t1 = time.perf_counter()
    state, result = dec.generate(state)
    return state, t1 - t0, time.perf_counter() - t0, result


def release(dec, state, n: int):
    """Slots 0..n-1 freed for the next round."""
    if dec.paged:
        return dec.unmap(state, list(range(n)))
    for slot in range(n):
        state = dec.free(state, slot)
    return state


def _requests(config, n: int, live: int, seed: int) -> list:
    from decode.engine.step.state import Request
    rng = np.random.default_rng(seed)
    return [Request(prompt=tuple(int(x) for x in rng.integers(0, config.vocab_size - 1, live)),
                    max_new_tokens=64, tau=0.4) for _ in range(n)]


def _one_round(dec, state, one, eight, rows: dict) -> object:
    """Every case once; its figures appended to `rows`."""
    for case, reqs in (("1 prompt", one), ("8 prompts", eight)):
        state, adm, ttft, res = admit_served(dec, state, reqs)
        rows[case].append((adm, ttft, res))
        state = release(dec, state, len(reqs))
    st, adm, ttft, res = admit_batched(dec, eight)
    rows["8 prompts, batched"].append((adm, ttft, res))
    del st
    return state


def resolved_attention(dec) -> str:
    """The cache attention a Decoder runs here: the paged kernel or path, or the dense cache's
    backend."""
    import jax
    import jax.numpy as jnp

    from wedlm_jax.attention import backends as ab
    from wedlm_jax.attention import paged as pa
    platform = jax.default_backend()
    if dec.static.page_size:
        return pa.implementation_for(platform, dec.static.attention)
    return ab.resolve(dec.static.attention, "cache", backend=platform, dtype=jnp.bfloat16)


def admit(smoke: bool, rounds: int, info: dict, live: int | None = None,
          page_size: int | None = None) -> dict:
    """The admission part (see the module docstring); `page_size` as the Decoder's (None: the
    platform's choice)."""
    import jax

    from benchmarks.shapes import DECODE_SHAPES, SMOKE_SHAPE, device_params, model_config
    from wedlm_jax.model import unstack_layers
    config = model_config(dict(SMOKE_SHAPE if smoke else DECODE_SHAPES["8b"]))
    live = live or (32 if smoke else 2048)
    params = device_params(config)
    if jax.default_backend() == "gpu":
        params = unstack_layers(params, config.num_layers)
    dec = served_decoder(params, config, capacity=capacity_for(live, smoke), page_size=page_size,
                         **ADMIT_SETTING)
    del params
    one, eight = _requests(config, 1, live, 0), _requests(config, 8, live, 1)
    rate, rate_from = card_rate(info)
    out = dict(ADMIT_SETTING, prompt_tokens=live, capacity=dec.capacity,
               page_size=dec.static.page_size, attention=resolved_attention(dec),
               prefill_chunk=dec.static.prefill_chunk,
               rows_prefilled=rows_prefilled(dec.method, live), rate=rate, rate_from=rate_from)
    rows = {"1 prompt": [], "8 prompts": [], "8 prompts, batched": []}
    t0 = time.perf_counter()
    state = _one_round(dec, dec.init_state(), one, eight, {k: [] for k in rows})   # compiles
    out["compile_s"] = round(time.perf_counter() - t0, 1)
    for _ in range(rounds):
        state = _one_round(dec, state, one, eight, rows)
    flops1 = prefill_flops(config, out["rows_prefilled"])
    out["cases"] = []
    for case, got in rows.items():
        n = 1 if case == "1 prompt" else 8
        adm = statistics.median(g[0] for g in got)
        res = got[-1][2]
        row = dict(case=case, prompts=n, admission_s=adm,
                   ttft_s=statistics.median(g[1] for g in got),
                   ttft_rounds=[round(g[1], 5) for g in got],
                   first_call_steps=res.steps,
                   first_tokens=all(len(res.new_ids(s)) > 0 for s in range(n)),
                   model_flops=n * flops1, prompt_tokens_per_s=n * live / adm)
        row["mfu"] = row["model_flops"] / adm / rate if rate else None
        out["cases"].append(row)
    return out
