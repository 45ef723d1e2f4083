"""Decoding: streaming parallel decoding (WeDLM Algorithm 1) with the block and AR baselines, as one
jitted while_loop over a preallocated KV cache (`decode.static.static_batch`); a no-cache reference
(`tests.decode_reference`); text and the `wedlm-decode` CLI (`decode.text`, `decode.cli`)."""

from decode.config import METHODS, DecodeConfig, DecodeConfigError, EngineOptions, Sampling
from decode.static.static_batch import DecodeResult, RowStats, generate

__all__ = ["METHODS", "DecodeConfig", "DecodeConfigError", "DecodeResult", "EngineOptions", "RowStats",
           "Sampling", "generate"]
