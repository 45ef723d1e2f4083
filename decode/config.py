"""Decoding configuration: one frozen dataclass, validated on construction (before anything compiles).

Fields follow docs/algorithm.md §3 and the paper's names: `window` (W), `tau` (entropy threshold),
`lam` (distance penalty lambda). Methods:

  streaming  the paper's Algorithm 1 (reorder, forward, commit the leading filled run, fill, slide);
  block      stop-and-wait block decoding: a block of W masks is resolved with the same fill rule and
             committed whole (one forward in natural order) only once every slot is filled;
  ar         ordinary cached next-token decoding (the AR reading of the same network);
  verified   streaming drafts whose commits are verified by the AR reading of the same forward:
             the output equals `ar` (decode/verified.py).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

METHODS = ("streaming", "block", "ar", "verified")
REFILLS = ("before", "after")               # decode.steps: when the window's masks are refilled
SAMPLING_ORDERS = ("filter_first", "temper_first")   # decode.sampling: filter vs temperature
MAX_STOP_IDS = 16  # stop ids travel as a fixed-size runtime array (padded with -1): no recompile per set
INT32_MAX = 2**31 - 1   # integer settings travel as int32 on the device
SEED_MAX = 2**32 - 1    # a request's seed is a uint32


class DecodeConfigError(ValueError):
    """A decoding setting or input that the engine cannot honour."""


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    method: str = "streaming"
    window: int = 16
    tau: float = 0.4
    lam: float = 0.02
    temperature: float = 0.0
    top_k: int = 0          # 0: off
    top_p: float = 1.0      # 1: off
    max_new_tokens: int = 256
    stop_token_ids: tuple = ()
    seed: int = 0
    prefill_chunk: int = 128  # static; the last chunk of a prompt is computed whole (padding included)
    refill: str = "before"    # 'before': the official engine's order (up to 2W slots a forward)
    sampling_order: str = "filter_first"  # the official engine's: top-k, top-p, then temperature

    def __post_init__(self):
        if self.method not in METHODS:
            raise DecodeConfigError(f"method {self.method!r} is unknown; allowed: {', '.join(METHODS)}")
        if self.refill not in REFILLS:
            raise DecodeConfigError(f"refill {self.refill!r} is unknown; allowed: {', '.join(REFILLS)}")
        if self.sampling_order not in SAMPLING_ORDERS:
            raise DecodeConfigError(f"sampling_order {self.sampling_order!r} is unknown; allowed: "
                                    f"{', '.join(SAMPLING_ORDERS)}")
        check_int("window", self.window, 1)
        check_number("tau", self.tau, 0.0)
        check_number("lam", self.lam, 0.0)
        check_number("temperature", self.temperature, 0.0)
        check_int("top_k", self.top_k, 0)
        if not _is_number(self.top_p) or not 0.0 < float(self.top_p) <= 1.0:
            raise DecodeConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("prefill_chunk", self.prefill_chunk, 1)
        check_int("seed", self.seed, 0, SEED_MAX)
        stops = self.stop_token_ids
        if isinstance(stops, int):
            stops = (stops,)
        stops = tuple(stops)
        for s in stops:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= INT32_MAX:
                raise DecodeConfigError(f"stop_token_ids must be ints in [0, {INT32_MAX}], got {s!r}")
        stops = tuple(dict.fromkeys(stops))
        if len(stops) > MAX_STOP_IDS:
            raise DecodeConfigError(f"at most {MAX_STOP_IDS} stop_token_ids, got {len(stops)}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0

    def replace(self, **kw) -> "DecodeConfig":
        return dataclasses.replace(self, **kw)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def check_number(name, value, low):
    """A DecodeConfigError naming `name` unless `value` is a finite number >= low (the one check
    of every float setting: DecodeConfig here, Request in decode.decoder)."""
    if not _is_number(value) or float(value) < low or float(value) == float("inf"):
        raise DecodeConfigError(f"{name} must be a finite number >= {low}, got {value!r}")


def check_int(name, value, low, high=INT32_MAX):
    """A DecodeConfigError naming `name` unless `value` is an int in [low, high] (int32 by
    default: integer settings travel as int32 on the device)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DecodeConfigError(f"{name} must be an int in [{low}, {high}], got {value!r}")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, capacity: int | None) -> list[list[int]]:
    """Validate token-id prompts: non-empty list of non-empty lists of ids in [0, vocab_size), each no
    longer than `capacity` (when given)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise DecodeConfigError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise DecodeConfigError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise DecodeConfigError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if capacity is not None and len(ids) > capacity:
            raise DecodeConfigError(f"prompt {i} has {len(ids)} tokens, longer than the capacity {capacity}")
        out.append(ids)
    return out


def resolve_mask_token(model_mask_id: int | None, given: int | None, method: str) -> int:
    """The [MASK] id: the one given, else the checkpoint's. AR decoding needs none (returns -1)."""
    mask_id = given if given is not None else model_mask_id
    if mask_id is None:
        if method == "ar":
            return -1
        raise DecodeConfigError(
            f"method {method!r} needs a mask token id: the checkpoint's config has no mask_token_id "
            "and none was given (pass mask_token_id=...)")
    return int(mask_id)
