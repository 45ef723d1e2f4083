"""The Decoders the benchmarks measure, built as the doors build theirs: a plan from the option
objects (`decode.config.EngineOptions` for the method and the slots, `Placement` for the cache),
then `Decoder(params, plan)`."""

from __future__ import annotations

from decode.config import EngineOptions, Placement
from decode.engine.runtime.decoder import Decoder
from decode.engine.planning.plan import make_plan


def decoder(params, config, *, page_size: int | None = None, num_pages: int | None = None,
            sampling: bool = True, lora=None, **engine) -> Decoder:
    """A float32 Decoder over `params` with these engine options (`engine`: method, window, slots,
    capacity, steps_per_call, ...), the cache `page_size` (0: dense; None: the platform's choice)
    and `num_pages`; `lora`: a decode.lora_options.LoraOptions (an adapter table); the [MASK] id
    is the model config's."""
    plan = make_plan(config, EngineOptions(**engine),
                     Placement(page_size=page_size, num_pages=num_pages), sampling=sampling,
                     lora=lora)
    return Decoder(params, plan)
