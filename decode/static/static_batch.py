"""Static-batch decoding: `generate()` runs a list of prompts to completion on a Decoder.

    result = generate(params, model_config, [[1, 2, 3], [4, 5]], DecodeConfig(method="streaming"))

Methods (docs/algorithm.md §3, the paper's Algorithm 1; the steps live in `decode/engine/step/steps.py`):

streaming  Each step, per row, with committed length `n` (cache rows 0..n-1 final) and a window of
           up to W slots at logical positions n, n+1, ... (each *filled* or [MASK]):
             1. reorder: physical order = filled slots ascending, then masks ascending (positions kept);
             2. forward the window on the cache at rows n.. (kv rows n + physical index); with
                refill 'before' (the official engine's order, the default) c [MASK] slots are
                appended first, c being the window's leading filled run;
             3. commit the leading filled run c (those slots were fed as filled tokens, so rows
                n..n+c-1 are final); emit them, stopping at the first stop token (inclusive);
             4. fill: entropy H_i of each remaining mask slot, d_i = i - (index of the first
                remaining mask), fill all with H_i + lam * d_i < tau, else the argmin; tokens come
                from the mask slot's own logits (greedy at temperature 0);
             5. slide: drop the c committed slots; with refill 'after' (docs/algorithm.md's
                order) masks are appended now, up to W. Never past the row's budget min(prompt + max_new_tokens,
                capacity).
block      The same step with commit restricted to "all slots of the block filled".
ar         Cached next-token decoding (AR reading of the same network).
verified   Streaming drafts with AR-verified commits (`decode/engine/step/verified.py`): output equal to `ar`.

`generate` is a client of `decode.engine.runtime.decoder.Decoder`: one slot per prompt (slots and capacity rounded
up to buckets, so a program compiles once per bucket), every prompt inserted, then chunks of steps
until every row is done; `on_commit` receives each row's new ids between chunks, and Ctrl-C stops
within one chunk with what was decoded. Continuous batching (requests joining and leaving slots)
is `decode.engine.runtime.batcher.Batcher` over the same Decoder.

Metrics: per row, `steps` = forwards while the row was live, `n_gen` = tokens emitted,
`token_slots` = token slots those forwards processed for the row (AR: 1 per step),
`tokens_per_forward = n_gen / steps`, `p_cache = n_gen / token_slots`. Totals sum the rows;
`loop_iterations` counts batched forwards.
`compile_s` is the setup time (prefill included) of a call that compiled a program, else 0.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from decode.config import (DecodeConfig, DecodeConfigError, EngineOptions, Method, Placement,
                           Sampling, check_prompts, useful_window)
from decode.engine.runtime.decoder import Decoder
from decode.engine.step.state import Request
from decode.engine.step.programs import compiled_count
from decode.engine.planning.plan import make_plan
from wedlm_jax.runtime import interrupts
from wedlm_jax import model as model_lib
from wedlm_jax import quantize as quantize_lib
from wedlm_jax.buckets import pow2_at_least
from wedlm_jax.config import ModelConfig

log = logging.getLogger(__name__)

MIN_CAPACITY_BUCKET = 64
STATIC_STEPS_PER_CALL = 32


def capacity_bucket(capacity: int) -> int:
    return pow2_at_least(capacity, MIN_CAPACITY_BUCKET)


def batch_bucket(batch: int, multiple: int = 1) -> int:
    return -(-pow2_at_least(batch) // multiple) * multiple


# ----------------------------------------------------------------------------------- results

@dataclasses.dataclass
class RowStats:
    steps: int          # forwards while the row was live
    n_gen: int          # tokens emitted
    token_slots: int    # token slots those forwards processed for the row
    tokens_per_forward: float
    p_cache: float
    finish: str  # 'stop' | 'length' (budget or capacity) | 'interrupted' (Ctrl-C came first)
    accepted: int = 0   # method 'verified': drafts accepted (and emitted)
    rejected: int = 0   # method 'verified': drafts that failed verification


@dataclasses.dataclass
class DecodeResult:
    tokens: list
    rows: list
    steps: int          # the rows' forwards, summed
    n_gen: int
    token_slots: int    # the rows' token slots, summed
    tokens_per_forward: float
    p_cache: float
    loop_iterations: int
    wall_s: float
    tokens_per_s: float
    compile_s: float
    method: str
    accepted: int = 0
    rejected: int = 0
    interrupted: bool = False
    logprobs: list | None = None   # per row, each token's log-probability (docs/algorithm.md §6)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ratio(a, b):
    return float(a) / float(b) if b else 0.0


# ----------------------------------------------------------------------------------- generate

def _requests(prompts, dc: DecodeConfig, capacity: int) -> list[Request | None]:
    """One Request per prompt with the row budget min(prompt + max_new_tokens, capacity) and the
    seed `dc.seed + row` (every row its own random stream; row i of a batch reproduces alone with
    seed + i); None for a prompt that already fills the capacity (nothing to generate)."""
    out = []
    for i, p in enumerate(prompts):
        room = min(dc.max_new_tokens, capacity - len(p))
        out.append(None if room < 1 else Request(
            prompt=tuple(p), **{**Sampling.pick(dc), "max_new_tokens": room,
                                "seed": (dc.seed + i) % (1 << 32)}))
    return out


def static_decoder(params, model_config: ModelConfig, num_prompts: int, dc: DecodeConfig,
                   capacity: int, longest_budget: int, *, mask_token_id=None,
                   placement: Placement = Placement(), allow_long: bool = False) -> Decoder:
    """The Decoder a static batch runs on: slots and capacity rounded up to buckets (one compile
    per bucket), the window limited to the longest row budget (no forward wider than the most
    tokens a row can still produce); `placement` as at every door (the batch over its mesh's
    data and fsdp axes, the heads over tensor; float weights are quantized by its `quantize`,
    weights quantized already decode under their own scheme)."""
    if not isinstance(placement, Placement):
        raise DecodeConfigError(f"placement must be a Placement, got {type(placement).__name__}")
    if not isinstance(dc, DecodeConfig):
        raise DecodeConfigError(f"decode_config must be a DecodeConfig, got {type(dc).__name__}")
    max_pos = model_config.max_position_embeddings
    if max_pos and capacity > max_pos and not allow_long:
        raise DecodeConfigError(
            f"capacity {capacity} (prompt + max_new_tokens) exceeds the model's "
            f"max_position_embeddings {max_pos}; positions past it were never trained (lower "
            "max_new_tokens / --capacity, or pass allow_long=True / --allow-long)")
    multiple = 1
    mesh = placement.make_mesh()
    if mesh is not None:
        multiple = int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
    window = useful_window(dc.window, dc.method, longest_budget)
    engine = EngineOptions(**Method.pick(dc), slots=batch_bucket(num_prompts, multiple),
                           capacity=capacity_bucket(capacity), steps_per_call=STATIC_STEPS_PER_CALL,
                           allow_long=True).replace(window=window)
    if placement.quantize == "none" and quantize_lib.is_quantized(params):   # quantized already
        quantize, group = quantize_lib.scheme_of(params)
        placement = dataclasses.replace(placement, quantize=quantize, quantize_group=group)
    return Decoder(params, make_plan(model_config, engine, placement, mesh=mesh,
                                     mask_token_id=mask_token_id, sampling=not dc.greedy,
                                     stacked_params=model_lib.layers_stacked(params)))


def _setup(params, model_config, prompts, dc, capacity, mask_token_id, placement,
           allow_long=False, decoder=None):
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise DecodeConfigError(f"capacity must be an int >= 1, got {capacity!r}")
    if not isinstance(dc, DecodeConfig):
        raise DecodeConfigError(f"decode_config must be a DecodeConfig, got {type(dc).__name__}")
    prompts = check_prompts(prompts, model_config.vocab_size, capacity)
    if capacity is None:
        capacity = max(len(p) for p in prompts) + dc.max_new_tokens
    requests = _requests(prompts, dc, capacity)
    budget = max([r.max_new_tokens for r in requests if r is not None], default=1)
    if decoder is None:
        decoder = static_decoder(params, model_config, len(prompts), dc, capacity, budget,
                                 mask_token_id=mask_token_id, placement=placement,
                                 allow_long=allow_long)
    for i, r in enumerate(requests):
        if r is not None:
            try:
                requests[i] = decoder.check_request(r)
            except DecodeConfigError as e:
                raise DecodeConfigError(f"prompt {i}: {e}") from None
    return decoder, prompts, requests


def generate(params, model_config: ModelConfig, prompts: Sequence[Sequence[int]],
             decode_config: DecodeConfig, *, capacity: int | None = None,
             mask_token_id: int | None = None, placement: Placement = Placement(),
             on_commit: Callable | None = None, allow_long: bool = False,
             decoder: Decoder | None = None, prompt_bucket: int | None = None,
             automata: Sequence | None = None,
             adapters: Sequence[str | None] | None = None) -> DecodeResult:
    """Decode every prompt (token-id lists) as one static batch on a Decoder; see the module
    docstring.

    capacity: the most tokens (prompt + generated) a row may hold; default max(prompt) +
    max_new_tokens. placement: dtype, mesh (the batch over its data and fsdp axes, the heads over
    tensor), attention kernel, KV tile, weight quantization, as at every door.
    on_commit(row, ids): called on the host after every chunk of steps with each row's newly
    committed ids.
    decoder: a Decoder to run on (its slots must hold the prompts); default one built for the
    batch, its weights quantized by the placement's `quantize`. Ctrl-C stops within one chunk of
    steps: the result holds what was decoded, with `interrupted` set. prompt_bucket: pad the
    prompts to at least this many tokens (one prefill program across batches of different
    prompt lengths; the tokens do not change). automata: per prompt a compiled constraint
    (decode.constraints.automaton.Automaton) or None: its output matches the constraint.
    adapters: per prompt the name of a LoRA adapter loaded in `decoder` (a Decoder planned with
    LoraOptions, `decoder.adapters.load(name, folder)`) or None for the base model.
    """
    dc = decode_config
    decoder, prompts, requests = _setup(params, model_config, prompts, dc, capacity,
                                        mask_token_id, placement, allow_long, decoder)
    if automata is not None:
        requests = _with_automata(decoder, requests, automata)
    if len(prompts) > decoder.slots:
        raise DecodeConfigError(f"{len(prompts)} prompts do not fit the decoder's {decoder.slots} slots")
    if prompt_bucket is not None and (not isinstance(prompt_bucket, int) or prompt_bucket < 1):
        raise DecodeConfigError(f"prompt_bucket must be an int >= 1, got {prompt_bucket!r}")
    requests = _with_adapters(decoder, requests, adapters)
    try:
        return _run(decoder, requests, prompts, dc, prompt_bucket, on_commit)
    finally:
        for r in requests:
            if r is not None and r.adapter:
                decoder.adapters.release(r.adapter)


def _with_automata(decoder, requests: list, automata: Sequence) -> list:
    """Each request with its prompt's compiled constraint (checked by the decoder; a logit_bias
    the constraint overrides is logged)."""
    if len(automata) != len(requests):
        raise DecodeConfigError(f"automata: {len(automata)} given for {len(requests)} prompts")
    requests = [r if r is None else decoder.check_request(
        dataclasses.replace(r, automaton=a)) for r, a in zip(requests, automata)]
    for i, r in enumerate(requests):
        warning = None if r is None else r.bias_warning(f"prompt {i}")
        if warning is not None:
            log.warning(warning)
    return requests


def _with_adapters(decoder, requests: list, names: Sequence | None) -> list:
    """Each request with the LoRA adapter row its prompt's name holds (None: the base); an
    unknown name, or names without a decoder serving adapters, refused before any is held."""
    if names is None:
        return requests
    if len(names) != len(requests):
        raise DecodeConfigError(f"adapters: {len(names)} given for {len(requests)} prompts")
    if decoder.adapters is None and any(n is not None for n in names):
        raise DecodeConfigError("adapters: the decoder serves no LoRA adapters (plan it with "
                                "LoraOptions(enable_lora=True))", "adapters")
    loaded = {a.name for a in decoder.adapters.loaded()} if decoder.adapters else set()
    unknown = sorted({n for n in names if n is not None} - loaded)
    if unknown:
        raise DecodeConfigError(f"adapters: {', '.join(map(repr, unknown))} not loaded in the "
                                "decoder", "adapters")
    return [r if r is None or n is None else
            dataclasses.replace(r, adapter=decoder.adapters.acquire(n))
            for r, n in zip(requests, names)]


def _run(decoder, requests: list, prompts, dc: DecodeConfig, prompt_bucket, on_commit):
    """The static batch's loop: prefill every prompt, then chunks of steps until every row is
    done (or Ctrl-C)."""
    t_setup, programs = time.perf_counter(), compiled_count()
    state = decoder.start(requests, prompt_bucket)   # every prompt prefilled in one batched call
    state, _ = decoder.generate(state, 0)  # compiles the step program; runs no step
    live = [i for i, r in enumerate(requests) if r is not None]
    jax.block_until_ready(state)
    # setup time (prefill included) when this call compiled anything, else 0
    setup_s = time.perf_counter() - t_setup if compiled_count() > programs else 0.0
    tokens = [[] for _ in prompts]
    logprobs = [[] for _ in prompts]
    iterations, interrupted = 0, False
    # generous: the first call ends at the rows' first tokens (Decoder.generate), the rest run
    # steps_per_call steps each
    max_chunks = (2 * (dc.max_new_tokens + 2 * decoder.window) + 8) // decoder.steps_per_call + 3
    t0 = time.perf_counter()
    done = np.asarray([r is None for r in requests])
    counters = counter_copies(state)   # the last chunk's, should Ctrl-C take the donated state
    try:
        with interrupts.graceful():   # Ctrl-C: the chunk in flight ends, its tokens kept
            for _ in range(max_chunks):
                if done.all():
                    break
                interrupts.check()
                state, res = decoder.generate(state)
                counters = counter_copies(state)
                done = res.done[:len(requests)]
                iterations += res.steps
                for i in live:
                    new = res.new_ids(i)
                    if new:
                        tokens[i].extend(new)
                        logprobs[i].extend(lp for lp, _ in res.new_logprobs(i))
                        if on_commit is not None:
                            on_commit(i, new)
            interrupts.check()        # asked during the last chunk: still told interrupted
            if not done.all():
                raise RuntimeError(f"decode loop stopped at its iteration cap ({iterations}) with "
                                   "rows unfinished")
    except KeyboardInterrupt:
        interrupted = True
    wall = time.perf_counter() - t0
    host = jax.device_get(counters)
    return _collect(tokens, host, requests, dc, wall, setup_s, iterations,
                    done if interrupted else None, logprobs)


def counter_copies(state) -> tuple:
    """Device copies of (steps, n_fwd, accepted, rejected) per slot, taken after a chunk (no host
    round trip): what the result reports when Ctrl-C came while the next call held the donated
    state (its buffers are gone; the tokens handed out before it are kept)."""
    return tuple(jnp.copy(x) for x in (state.steps, state.n_fwd, state.accepted, state.rejected))


def _collect(tokens, host, requests, dc: DecodeConfig, wall, compile_s, iterations,
             done_when_interrupted, logprobs=None) -> DecodeResult:
    """The result; `done_when_interrupted`: None, or (Ctrl-C) the rows done by then: the others'
    finish is 'interrupted'."""
    interrupted = done_when_interrupted is not None
    steps_a, nfwd_a, acc_a, rej_a = host
    rows = []
    stops = set(dc.stop_token_ids)
    for r, ids in enumerate(tokens):
        live = requests[r] is not None
        steps = int(steps_a[r]) if live else 0
        nfwd = int(nfwd_a[r]) if live else 0
        finish = "stop" if ids and ids[-1] in stops else "length"
        if interrupted and live and not done_when_interrupted[r]:
            finish = "interrupted"
        rows.append(RowStats(steps=steps, n_gen=len(ids), token_slots=nfwd,
                             tokens_per_forward=_ratio(len(ids), steps),
                             p_cache=_ratio(len(ids), nfwd), finish=finish,
                             accepted=int(acc_a[r]) if live else 0,
                             rejected=int(rej_a[r]) if live else 0))
    n_gen = sum(r.n_gen for r in rows)
    steps = sum(r.steps for r in rows)
    slots = sum(r.token_slots for r in rows)
    return DecodeResult(tokens=tokens, rows=rows, steps=steps, n_gen=n_gen, token_slots=slots,
                        tokens_per_forward=_ratio(n_gen, steps), p_cache=_ratio(n_gen, slots),
                        loop_iterations=iterations, wall_s=wall,
                        tokens_per_s=_ratio(n_gen, wall), compile_s=compile_s, method=dc.method,
                        accepted=sum(r.accepted for r in rows),
                        rejected=sum(r.rejected for r in rows), interrupted=interrupted,
                        logprobs=logprobs)


def trace_steps(params, model_config: ModelConfig, prompts, decode_config: DecodeConfig, *,
                capacity: int | None = None, mask_token_id: int | None = None,
                placement: Placement = Placement(), max_steps: int = 10_000):
    """Debug hook: the same prefill and step functions, one jitted step at a time from a host loop.
    Returns (steps, final) where steps is a list of host dicts (the step's aux: fed tokens,
    positions, logits in physical order, n, live, wlen, commit) and final holds the state arrays
    (out [B, L] emitted ids, count, n, tok, done, cache layers)."""
    decoder, prompts, requests = _setup(params, model_config, prompts, decode_config, capacity,
                                        mask_token_id, placement)
    state = decoder.start(requests)
    trace, out = [], [[] for _ in range(decoder.slots)]
    while not bool(np.all(np.asarray(state.done))) and len(trace) < max_steps:
        state, aux = decoder.step_with_aux(state)
        aux = jax.device_get(aux)
        for b in range(decoder.slots):
            out[b].extend(aux["emitted_tokens"][b, :aux["emitted_count"][b]].tolist())
        trace.append(aux)
    width = max(1, max(len(o) for o in out))
    out_arr = np.zeros((decoder.slots, width), np.int32)
    for b, o in enumerate(out):
        out_arr[b, :len(o)] = o
    final = dict(out=out_arr, count=np.asarray([len(o) for o in out], np.int32),
                 n=np.asarray(state.n), tok=np.asarray(state.tok), done=np.asarray(state.done),
                 steps=np.asarray(state.steps), cache=jax.device_get(state.cache.layers),
                 num_prompts=len(prompts))
    return trace, final
