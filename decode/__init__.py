"""Decoding: streaming parallel decoding (WeDLM Algorithm 1) with the block, AR and verified
methods, as jitted while_loops over a preallocated KV cache; text and the `wedlm-decode` CLI.

The user's surface, one import (each name loaded when first used, so `import decode` itself
loads no engine):

    from decode import (OpenCheckpoint, Placement, EngineOptions, Sampling, DecodeConfig,
                        Request, make_plan, Decoder, Batcher, generate)
    from decode import Constraint, compile_for                 # structured outputs
    from decode import parse_tools, split_calls                # tool calling
    from decode import LoraOptions                             # LoRA adapters, one batch:
    #   plan = make_plan(config, engine, lora=LoraOptions(enable_lora=True, max_loras=4))
    #   decoder = Decoder(params, plan); decoder.adapters.load("sql", "path/to/peft-folder")
    #   Batcher(decoder).submit(Request(prompt=ids), adapter="sql")      # None: the base
    #   generate(params, config, prompts, dc, decoder=decoder, adapters=["sql", None])
"""

import importlib

_SURFACE = {
    "METHODS": "decode.config", "DecodeConfig": "decode.config",
    "DecodeConfigError": "decode.config", "EngineOptions": "decode.config",
    "Placement": "decode.config", "Sampling": "decode.config",
    "OpenCheckpoint": "decode.checkpoint",
    "Request": "decode.engine.step.state", "make_plan": "decode.engine.planning.plan",
    "Decoder": "decode.engine.runtime.decoder", "Batcher": "decode.engine.runtime.batcher",
    "generate": "decode.static.static_batch", "DecodeResult": "decode.static.static_batch",
    "RowStats": "decode.static.static_batch",
    "Constraint": "decode.constraints.spec", "compile_for": "decode.constraints.backends",
    "parse_tools": "decode.tools.request", "ToolRequest": "decode.tools.request",
    "split_calls": "decode.tools.calls",
    "LoraOptions": "decode.lora_options", "Adapters": "decode.engine.runtime.adapters",
}

__all__ = sorted(_SURFACE)


def __getattr__(name: str):
    if name not in _SURFACE:
        raise AttributeError(f"module 'decode' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SURFACE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_SURFACE))
