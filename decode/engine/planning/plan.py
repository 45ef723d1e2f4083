"""The decoding plan: every static decision a Decoder is built on, made and checked once.

    plan = make_plan(model_config, EngineOptions(method="streaming", window=16, slots=8,
                                                 capacity=1024),
                     Placement(dtype="bf16", page_size=64))
    decoder = Decoder(params, plan)

`make_plan` takes the option objects the doors build (decode/config.py: `EngineOptions` for the
method and the slots, `Placement` for the device side), the target (`mesh`: a jax Mesh whose
devices may be a compile-only topology, or None for this process's first device) and the few
settings only a program sets (the [MASK] id, whether sampled requests are accepted, the top
log-probabilities carried, a memory budget), and resolves everything the compiled programs depend
on: the mask id (`decode.config.mask_id_for`, the one rule), the cache (dense, or pages of which
size and how many), the attention kernel and its tiles, the cache rows, whether the weights'
layers are stacked, the memory estimate against the budget. A setting that cannot work raises
`DecodeConfigError` naming it, before any weight is placed or anything compiles. The `Plan` is
frozen: the Decoder and the ahead-of-time compiles (decode/compile/aot.py) read it, never change it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from decode.engine.planning import layouts
from decode.config import (MAX_LOGPROBS, DecodeConfigError, DoorOptions, EngineOptions, Placement,
                           check_int, check_slots, is_int, mask_id_for, prompt_problem)
from decode.engine.planning.memory import available_memory, estimate_memory
from decode.lora_options import LoraOptions
from decode.engine.runtime.pages import pool_size
from decode.engine.step.programs import Static
from decode.engine.step.state import Request
from decode.engine.step.steps import StepSpec
from wedlm_jax.runtime.failures import format_bytes
from wedlm_jax.attention import backends as attn_backends
from wedlm_jax.attention import table as attn_table
from wedlm_jax.attention import cache as ca
from wedlm_jax.attention import paged
from wedlm_jax import grouped_matmul as grouped_lib
from wedlm_jax.config import ModelConfig

ROW_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    """A Decoder's static decisions (see the module docstring). `static` is what the compiled
    programs are keyed by; the rest is what the host side of the Decoder needs."""
    static: Static
    model_config: ModelConfig
    engine: EngineOptions       # the options it was made from, as given
    placement: Placement
    mask_id: int
    steps_per_call: int
    sampling: bool
    mesh: Any                   # a jax Mesh, or None: this process's first device
    weight_layout: str          # "compiler" | "default" (resolved for the platform)
    memory_estimate: dict

    method = property(lambda self: self.static.spec.method)
    window = property(lambda self: self.static.spec.window)
    refill = property(lambda self: self.static.spec.refill)
    slots = property(lambda self: self.static.slots)
    capacity = property(lambda self: self.static.capacity)
    paged = property(lambda self: self.static.paged)

    @property
    def device(self):
        """The target's first device (its platform decides kernels and layouts)."""
        return self.mesh.devices.flat[0] if self.mesh is not None else jax.local_devices()[0]

    def check_request(self, request: Request) -> Request:
        """Validate a request for a Decoder of this plan before any device work; raises
        DecodeConfigError naming the field. (Its own settings were checked when it was made:
        Sampling.) Returns it with the prompt as a tuple of ints."""
        if not isinstance(request, Request):
            raise DecodeConfigError(f"expected a Request, got {type(request).__name__}")
        r, vocab = request, self.model_config.vocab_size
        prompt = r.prompt
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") or len(prompt) == 0:
            raise DecodeConfigError("prompt must be a non-empty sequence of token ids", "prompt")
        problem = prompt_problem(prompt, vocab, self.capacity)
        if problem:
            raise DecodeConfigError(f"prompt: {problem}", "prompt")
        if not (is_int(r.top_logprobs) and 0 <= r.top_logprobs <= self.static.spec.top_logprobs):
            raise DecodeConfigError(f"top_logprobs must be an int in [0, {self.static.spec.top_logprobs}] "
                                    f"(the Decoder's top_logprobs), got {r.top_logprobs!r}", "top_logprobs")
        if r.temperature > 0 and not self.sampling:
            raise DecodeConfigError("temperature > 0 needs a Decoder built with sampling=True")
        if r.logit_bias and r.logit_bias[-1][0] >= vocab:     # (id, bias) pairs by id: Sampling
            raise DecodeConfigError(f"logit_bias: token id {r.logit_bias[-1][0]} is outside the "
                                    f"vocabulary [0, {vocab})", "logit_bias")
        if not all(s < vocab for s in r.stop_token_ids):     # ids, normalised by Sampling
            bad = next(s for s in r.stop_token_ids if s >= vocab)
            raise DecodeConfigError(f"stop_token_ids: {bad!r} is outside the vocabulary [0, {vocab})",
                                    "stop_token_ids")
        if r.automaton is not None and r.automaton.vocab_size > vocab:
            raise DecodeConfigError(f"the constraint's automaton is over {r.automaton.vocab_size} "
                                    f"tokens, more than the model's vocabulary {vocab}",
                                    "constraint")
        if r.automaton is not None and not r.stop_token_ids:
            raise DecodeConfigError("a constrained request needs a stop token id (the model's eos: "
                                    "its output ends there once the constraint is met)",
                                    "stop_token_ids")
        if (getattr(r.automaton, "backend", "device") == "host"
                and self.static.spec.method == "block"):
            raise DecodeConfigError("block decoding does not take a constraint on the host "
                                    "backend (its blocks never settle under the parser); use "
                                    "streaming, verified or ar, or a schema the device tables "
                                    "enforce", "constraint")
        if (getattr(r.automaton, "backend", "device") == "host" and self.mesh is not None
                and self.mesh.size > 1):
            raise DecodeConfigError("a constraint on the host backend needs a single-device "
                                    "placement (the device tables work on any mesh)", "constraint")
        if not (is_int(r.adapter) and 0 <= r.adapter <= self.static.max_loras):
            raise DecodeConfigError(f"adapter must be a LoRA table row in [0, "
                                    f"{self.static.max_loras}] (--max-loras), got {r.adapter!r}",
                                    "adapter")
        return dataclasses.replace(r, prompt=tuple(int(t) for t in prompt))

    def replace(self, **static_fields) -> "Plan":
        """This plan with fields of `static` replaced (e.g. scan_unroll for a cost compile)."""
        return dataclasses.replace(self, static=dataclasses.replace(self.static, **static_fields))


def make_plan(model_config: ModelConfig, engine: EngineOptions, placement: Placement = Placement(),
              *, mesh=None, mask_token_id: int | None = None, sampling: bool = True,
              top_logprobs: int = 0, memory_limit_bytes: int | None = None,
              stacked_params: bool = True, continuous: bool = False,
              lora: LoraOptions | None = None) -> Plan:
    """The Plan of a Decoder for `model_config` (see the module docstring). `stacked_params`:
    whether the weights it will get have their layers stacked (as loaded on every platform but
    GPU, decode.checkpoint). `continuous`: the Decoder serves a continuous-batching door (the
    server, the batch job), whose default cache may differ (`paged.auto_page_size`). `lora`:
    the LoRA adapter table's shape (decode/lora_options.py; None or not enabled: no table)."""
    check_engine(model_config, engine)
    quantize_group = placement.check_model(model_config)
    method = engine.method
    mask_id = mask_id_for(model_config, mask_token_id, method)
    check_int("top_logprobs", top_logprobs, 0, MAX_LOGPROBS)
    spec = StepSpec(method=method, window=1 if method == "ar" else engine.window,
                    refill=engine.refill, sampling=sampling, top_logprobs=int(top_logprobs))
    shards = 1 if mesh is None else int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
    check_slots(engine.slots, shards)
    device = mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
    rows = -(-(engine.capacity + spec.span) // ROW_ALIGN) * ROW_ALIGN
    grouped = grouped_lib.for_plan(device.platform, quantize_group,
                                   1 if mesh is None else mesh.devices.size)
    cache = cache_choice(model_config, placement, spec, engine, rows, shards, device,
                         1 if mesh is None else int(mesh.shape.get("tensor", 1)), continuous)
    static = Static(
        config=model_config.replace(mask_token_id=None, bos_token_id=None, eos_token_id=None,
                                    pad_token_id=None),
        dtype=jnp.dtype(placement.dtype).name, spec=spec, slots=engine.slots,
        capacity=engine.capacity, rows=rows, kv_tile=min(cache["kv_tile"], rows),
        prefill_chunk=min(engine.prefill_chunk, rows), keep_q=(method == "verified" and sampling),
        attention=cache["attention"],
        mesh=None if mesh is None else (tuple(mesh.axis_names), tuple(mesh.devices.shape),
                                         tuple(d.id for d in mesh.devices.flat)),
        platform=None if mesh is None else device.platform,
        page_size=cache["page_size"], num_pages=cache["num_pages"],
        page_shards=shards if cache["page_size"] else 1,
        stacked_layers=(layouts.layers_stacked(device.platform, grouped == grouped_lib.PALLAS)
                        and stacked_params),
        quantize=placement.quantize, quantize_group=quantize_group, kv_dtype=placement.kv_dtype,
        grouped_matmul=grouped, max_loras=lora.rows if lora else 0,
        max_lora_rank=lora.rank if lora else 0)
    memory = estimate_memory(static)
    check_memory(memory, memory_limit_bytes if memory_limit_bytes is not None
                 else available_memory(mesh), static)
    try:
        weight_layout = layouts.resolve(placement.weight_layout, device.platform,
                                        placement.quantize != "none", bool(static.max_loras))
    except ValueError as e:
        raise DecodeConfigError(str(e), "weight_layout") from None
    return Plan(static=static, model_config=model_config, engine=engine, placement=placement,
                mask_id=mask_id,
                steps_per_call=engine.steps_per_call, sampling=sampling, mesh=mesh,
                weight_layout=weight_layout, memory_estimate=memory)


def door_plan(opts: DoorOptions, model_config: ModelConfig, *, capacity: int, mesh=None,
              mask_token_id: int | None = None, top_logprobs: int = 0,
              stacked_params: bool = True) -> Plan:
    """The plan of a door's Decoder (wedlm-decode --input, wedlm-serve): its options as parsed,
    the capacity it sized, the checkpoint's mask id and the mesh the weights were loaded on."""
    return make_plan(model_config, opts.engine.replace(capacity=capacity), opts.placement,
                     mesh=mesh, mask_token_id=mask_token_id, top_logprobs=top_logprobs,
                     stacked_params=stacked_params, continuous=True, lora=opts.lora)


def check_engine(config: ModelConfig, engine: EngineOptions) -> None:
    """The engine options against the model: a capacity given, the window inside it, positions
    the model was trained on (unless allow_long)."""
    if not isinstance(engine, EngineOptions):
        raise DecodeConfigError(f"expected EngineOptions, got {type(engine).__name__}")
    if engine.capacity is None:
        raise DecodeConfigError("capacity must be given: the most positions (prompt + generated) "
                                "a slot holds", "capacity")
    if engine.method != "ar" and engine.window > engine.capacity:
        raise DecodeConfigError(f"window {engine.window} is larger than the capacity "
                                f"{engine.capacity}: a slot never holds more than "
                                f"{engine.capacity} positions", "window")
    max_pos = config.max_position_embeddings
    if max_pos and engine.capacity > max_pos and not engine.allow_long:
        raise DecodeConfigError(
            f"capacity {engine.capacity} exceeds the model's max_position_embeddings {max_pos}; "
            "positions past it were never trained (pass allow_long=True / --allow-long to decode "
            "there anyway)", "capacity")


def cache_choice(config: ModelConfig, placement: Placement, spec: StepSpec, engine: EngineOptions,
                 rows: int, shards: int, device, tensor: int, continuous: bool = False) -> dict:
    """{page_size, num_pages, attention, kv_tile}: the cache and the kernel reading it. No page
    size given: the platform's choice, `paged.auto_page_size` (paged 64 on TPU; for a
    continuous-batching door pages of 64 on GPU, read by the Triton paged kernel, and of 16 on
    CPU; the dense cache for a static batch off TPU)."""
    platform, device_smem = device.platform, ca.smem_limit(device)
    page_size, num_pages = placement.page_size, placement.num_pages
    attention, kv_tile, dtype = placement.attention, placement.kv_tile, jnp.dtype(placement.dtype)
    if page_size is None and num_pages is None:
        page_size = paged.auto_page_size(platform, config.num_heads, config.num_kv_heads,
                                         config.head_dim, dtype,
                                         tensor, continuous=continuous)
    if placement.kv_dtype == "int8":
        attention, page_size = int8_cache(attention, platform, page_size,
                                          placement.page_size is None)
    page_size, num_pages = pool_size(page_size or None, num_pages, rows, engine.slots, shards)
    try:
        if page_size:
            attention = paged.choose_attention(attention, platform, page_size, config.head_dim,
                                               dtype.itemsize, device_smem)
            kv_tile = paged.gather_tile(platform, kv_tile, page_size)      # the gather path's
            if paged.implementation_for(platform) == paged.RAGGED:
                paged.check_ragged(config.num_heads, config.num_kv_heads, config.head_dim, dtype,
                                   tensor)
        elif attn_table.BACKENDS[attention if attention != attn_table.AUTO else
                                 attn_backends.resolve(attention, "cache", backend=platform,
                                                       dtype=dtype)].smem_tile:
            # the Triton kernel's tile must fit the device's shared memory
            q_rows = max(spec.span, engine.prefill_chunk) * (config.num_heads // config.num_kv_heads)
            kv_tile = ca.pallas_tile(min(kv_tile, rows), q_rows, config.head_dim, dtype.itemsize,
                                     device_smem)
    except ValueError as e:
        if page_size and paged.RAGGED in str(e):
            raise DecodeConfigError(f"--page-size on {platform}: {e}; use --page-size 0 (the "
                                    "dense cache)", "page_size") from None
        raise DecodeConfigError(str(e)) from None
    return dict(page_size=page_size, num_pages=num_pages, attention=attention, kv_tile=kv_tile)


def int8_cache(attention: str, platform: str, page_size: int, auto_pages: bool) -> tuple:
    """(attention, page_size) for an int8 KV cache, which the XLA paths read (the dense cache's
    tiled / dense attention, the paged gather path) and the kernels do not: "auto" becomes
    "tiled"; the default pages of TPU and GPU become the dense cache (the ragged kernel and the
    Triton paged kernel read float pages, and the gather path that would read int8 pages stepped
    slower than the dense cache on an H100); a kernel asked for by name is refused, naming it and
    what to use."""
    if page_size and auto_pages and platform in ("gpu", "cuda", "rocm"):
        page_size = 0
    if page_size and paged.implementation_for(platform) == paged.RAGGED:
        if not auto_pages:
            raise DecodeConfigError("--kv-dtype int8 is not read by the TPU ragged paged attention "
                                    "kernel; use --page-size 0 (the dense cache, tiled attention)",
                                    "kv_dtype")
        page_size = 0
    try:
        return attn_table.for_int8_cache(attention), page_size
    except ValueError as e:
        raise DecodeConfigError(str(e), "kv_dtype") from None


def check_memory(memory: dict, limit: int | None, static: Static) -> None:
    gib = lambda n: format_bytes(n, "GiB")
    if limit is not None and memory["total"] > limit:
        raise DecodeConfigError(
            f"decoding needs ~{gib(memory['total'])} (KV cache {gib(memory['cache'])}, logits "
            f"{gib(memory['logits'])}, draft distributions {gib(memory['q'])}) per device for "
            f"{static.slots} slots x {static.rows} cache rows, more than the {gib(limit)} "
            "available; lower the capacity (--capacity / --max-new-tokens), the slots or the window")
