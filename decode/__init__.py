"""Decoding: streaming parallel decoding (WeDLM Algorithm 1) with the block and AR baselines, as one
jitted while_loop over a preallocated KV cache (`decode.engine`); a no-cache reference
(`decode.reference`); text and the `wedlm-decode` CLI (`decode.text`, `decode.cli`)."""

from decode.config import METHODS, DecodeConfig, DecodeConfigError
from decode.engine import DecodeResult, RowStats, generate

__all__ = ["METHODS", "DecodeConfig", "DecodeConfigError", "DecodeResult", "RowStats", "generate"]
