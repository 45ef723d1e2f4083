"""Decoders for the tests from one flat set of keywords: the engine's (decode.config.EngineOptions),
the placement's (Placement) and the plan's own (mesh, mask_token_id, sampling, top_logprobs,
memory_limit_bytes) split as `decode.engine.planning.plan.make_plan` takes them. Test scaffolding: the doors and
the library build the option objects themselves."""

from __future__ import annotations

import jax.numpy as jnp

from decode.config import EngineOptions, Placement
from decode.engine.runtime.decoder import Decoder
from decode.engine.planning.plan import make_plan
from wedlm_jax.model import layers_stacked

PLAN_KEYS = ("mesh", "mask_token_id", "sampling", "top_logprobs", "memory_limit_bytes", "lora")


def plan(config, params=None, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k in PLAN_KEYS}     # mesh: the jax Mesh itself
    engine = {k: kw.pop(k) for k in list(kw) if k in EngineOptions.options()}
    engine.setdefault("capacity", 1024)
    place = {k: kw.pop(k) for k in list(kw) if k in Placement.__dataclass_fields__}
    if "dtype" in place:
        place["dtype"] = jnp.dtype(place["dtype"]).name
    if kw:
        raise TypeError(f"unknown Decoder settings: {sorted(kw)}")
    stacked = layers_stacked(params) if params else True
    return make_plan(config, EngineOptions(**engine), Placement(**place), stacked_params=stacked,
                     **extra)


def decoder(params, config, **kw) -> Decoder:
    return Decoder(params, plan(config, params, **kw))
