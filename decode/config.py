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
MAX_LOGPROBS = 20       # top alternatives per token (OpenAI's and vLLM's limit)


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


# ------------------------------------------------------------------------------- placement

DTYPES = {"float32": "float32", "f32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
CACHE_ATTENTION = ("auto", "tiled", "dense", "pallas", "cudnn")   # wedlm_jax.attention_backends
MESH_AXES = ("data", "fsdp", "tensor")


def parse_mesh(text: str) -> tuple[int, int, int]:
    """'data=2,tensor=4' -> (2, 1, 4); axes not named are 1."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise DecodeConfigError(f"--mesh {text!r}: expected comma-separated AXIS=N with AXIS one "
                                    f"of {', '.join(MESH_AXES)} and N >= 1 (e.g. data=2,tensor=4)")
        sizes[name] = int(value)
    return tuple(sizes[a] for a in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where and how the weights and the cache live, the same at every door (wedlm-decode, the
    batch job, wedlm-serve): compute/storage dtype, the ('data', 'fsdp', 'tensor') mesh (slots
    over data x fsdp, heads over tensor), the cache-attention backend and its KV tile."""
    dtype: str = "float32"
    mesh: tuple = (1, 1, 1)
    attention: str = "auto"
    kv_tile: int = 256
    page_size: int | None = None    # a paged KV cache of pages of this many rows (None: dense)
    num_pages: int | None = None    # the paged cache's pages per layer (None: slots x per sequence)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise DecodeConfigError(f"dtype {self.dtype!r} is unknown; allowed: float32, bfloat16 "
                                    "(f32, bf16)")
        object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if len(self.mesh) != 3:
            raise DecodeConfigError(f"mesh must be (data, fsdp, tensor), got {self.mesh!r}")
        for name, n in zip(MESH_AXES, self.mesh):
            check_int(f"mesh {name}", n, 1)
        if self.attention not in CACHE_ATTENTION:
            raise DecodeConfigError(f"attention {self.attention!r} is unknown; allowed: "
                                    f"{', '.join(CACHE_ATTENTION)}")
        check_int("kv_tile", self.kv_tile, 1)
        if self.page_size is not None:
            check_int("page_size", self.page_size, 1)
        if self.num_pages is not None:
            if self.page_size is None:
                raise DecodeConfigError("--num-pages needs --page-size (a paged cache)")
            check_int("num_pages", self.num_pages, 1)

    @property
    def devices_needed(self) -> int:
        return self.mesh[0] * self.mesh[1] * self.mesh[2]

    @property
    def batch_shards(self) -> int:
        return self.mesh[0] * self.mesh[1]

    def make_mesh(self, devices=None):
        """The mesh over the first `devices_needed` of this process's devices (None for a
        single device; decoding never spans processes: on several hosts each decodes its own
        share); a DecodeConfigError naming both counts when there are fewer."""
        if self.devices_needed == 1:
            return None
        import jax
        from wedlm_jax.sharding import make_mesh
        devices = list(jax.local_devices() if devices is None else devices)
        if len(devices) < self.devices_needed:
            raise DecodeConfigError(
                f"--mesh data={self.mesh[0]},fsdp={self.mesh[1]},tensor={self.mesh[2]} needs "
                f"{self.devices_needed} devices; {len(devices)} {devices[0].platform} device(s) here")
        return make_mesh(*self.mesh, devices=devices[:self.devices_needed])

    def check_model(self, config) -> None:
        """The mesh against the model's shape: heads and KV heads split over `tensor`."""
        t = self.mesh[2]
        if config.num_kv_heads % t or config.num_heads % t:
            raise DecodeConfigError(f"--mesh tensor={t} does not divide the model's "
                                    f"{config.num_heads} heads / {config.num_kv_heads} KV heads")

    @staticmethod
    def add_arguments(parser) -> None:
        d = Placement()
        g = parser.add_argument_group("placement (the same for wedlm-decode, the batch job and "
                                      "wedlm-serve)")
        g.add_argument("--dtype", default=d.dtype, help="weights, activations and KV cache: "
                                                        "float32 or bfloat16 (f32, bf16)")
        g.add_argument("--mesh", default="", help="devices as AXIS=N over data, fsdp, tensor "
                                                  "(e.g. tensor=4: heads over 4 devices; data=2: "
                                                  "slots over 2); default one device")
        g.add_argument("--attention", default=d.attention,
                       help=f"cache-attention backend: one of {', '.join(CACHE_ATTENTION)}")
        g.add_argument("--kv-tile", type=int, default=d.kv_tile,
                       help="KV cache rows per attention tile (tiled, pallas)")
        g.add_argument("--page-size", type=int, default=None,
                       help="a paged KV cache shared by the slots, pages of this many rows, with "
                            "prompt-prefix reuse (--input and wedlm-serve; default: each slot "
                            "reserves its capacity)")
        g.add_argument("--num-pages", type=int, default=None,
                       help="the paged cache's pages (default: slots x pages of one sequence at "
                            "the capacity)")

    @staticmethod
    def add_dry_run_arguments(parser, who: str) -> None:
        """`--dry-run --topology T [--device-memory GiB]` (decode.aot.dry_run_door): the door's
        programs compiled for an accelerator from config.json alone."""
        d = parser.add_argument_group(f"dry run: compile {who}'s programs for an accelerator from "
                                      "config.json alone (no weights, no accelerator) and say if "
                                      "they fit")
        d.add_argument("--dry-run", action="store_true")
        d.add_argument("--topology", help="a TPU topology libtpu describes, e.g. v5e:2x4 or "
                                          "tpu:v5p:2x2x2")
        d.add_argument("--device-memory", type=float, default=None,
                       help="GiB per chip to fit in (default: the chip's HBM)")

    @classmethod
    def from_args(cls, args) -> "Placement":
        return cls(dtype=args.dtype, mesh=parse_mesh(args.mesh), attention=args.attention,
                   kv_tile=args.kv_tile, page_size=getattr(args, "page_size", None),
                   num_pages=getattr(args, "num_pages", None))


# ------------------------------------------------------------------------- the doors' options

DOORS = ("wedlm-decode", "wedlm-serve")
SERVE_CAPACITY = 2048     # wedlm-serve's default capacity (wedlm-decode sizes it from its prompts)


def add_decoding_arguments(parser, door: str) -> None:
    """The decoding options the doors share (wedlm-decode with its batch job, wedlm-serve), each
    defined once here with its default (DecodeConfig's) and its help: the compile-time group,
    which fixes the Decoder's programs, and the per-request settings (on the server, every
    request's defaults; a request may set its own). `decoding_args_config` checks them."""
    if door not in DOORS:
        raise ValueError(f"door must be one of {DOORS}, got {door!r}")
    d, serve = DecodeConfig(), door == "wedlm-serve"
    g = parser.add_argument_group("decoding, compile-time (the programs are built for these)")
    g.add_argument("--method", default=d.method, help=f"one of {', '.join(METHODS)}")
    g.add_argument("--window", type=int, default=d.window,
                   help="W: undecided slots in the window (limited to the budget)")
    g.add_argument("--refill", default=d.refill,
                   help=f"one of {', '.join(REFILLS)}: 'before' is the official engine's order "
                        "(up to 2W slots a forward, up to W tokens a forward), 'after' SPEC's "
                        "(W slots, up to W/2 tokens)")
    g.add_argument("--slots", type=int, default=16,
                   help="requests decoded at once" + ("" if serve else " (--input)"))
    g.add_argument("--steps-per-call", type=int, default=8,
                   help="decode steps per device call (a chunk)" + ("" if serve else " (--input)"))
    g.add_argument("--capacity", type=int, default=SERVE_CAPACITY if serve else None,
                   help="cache capacity per request (prompt + generated tokens)"
                        + ("" if serve else "; default: the longest prompt + its new tokens"))
    g.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help="prompt tokens per prefill forward")
    g.add_argument("--allow-long", action="store_true",
                   help="allow a capacity past the model's max_position_embeddings")
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="the [MASK] id (default: config.json's, else the tokenizer's <|mask|>)")
    g.add_argument("--no-default-stops", action="store_true",
                   help="do not stop at eos / <|im_end|> from the tokenizer and generation_config.json")
    r = parser.add_argument_group("per-request settings" + (" (a request's defaults)" if serve else ""))
    r.add_argument("--tau", type=float, default=d.tau,
                   help="commit every window slot whose adjusted entropy is below tau (>= 0)")
    r.add_argument("--lam", type=float, default=d.lam,
                   help="lambda: the distance penalty added to a slot's entropy per position it "
                        "lies past the first undecided one (>= 0)")
    r.add_argument("--sampling-order", default=d.sampling_order,
                   help=f"one of {', '.join(SAMPLING_ORDERS)}: filter_first is the official "
                        "engine's (top-k, top-p, then temperature), temper_first transformers'")
    r.add_argument("--max-tokens" if serve else "--max-new-tokens", dest="max_new_tokens", type=int,
                   default=d.max_new_tokens, help="tokens to generate per request")
    if serve:      # the rest of a request's sampling settings come with the request
        return
    r.add_argument("--temperature", type=float, default=d.temperature,
                   help="0: greedy; > 0: sample the committed tokens")
    r.add_argument("--top-k", type=int, default=d.top_k, help="sample among the k likeliest (0: all)")
    r.add_argument("--top-p", type=float, default=d.top_p, help="nucleus mass in (0, 1]")
    r.add_argument("--seed", type=int, default=d.seed, help="sampling seed, in [0, 2**32)")


def decoding_args_config(args) -> DecodeConfig:
    """Every shared option of a door checked once, before anything loads (a DecodeConfigError
    naming the option): the per-request settings as a DecodeConfig (its bounds), the
    compile-time integers, and the slots against the placement's mesh."""
    kw = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "seed") if hasattr(args, k)}
    dc = DecodeConfig(method=args.method, window=args.window, tau=args.tau, lam=args.lam,
                      max_new_tokens=args.max_new_tokens, refill=args.refill,
                      prefill_chunk=args.prefill_chunk, sampling_order=args.sampling_order, **kw)
    for name in ("slots", "steps_per_call", "capacity"):
        v = getattr(args, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= INT32_MAX):
            raise DecodeConfigError(f"--{name.replace('_', '-')} must be in [1, {INT32_MAX}], got {v}")
    placement = Placement.from_args(args)
    if args.slots % placement.batch_shards:
        raise DecodeConfigError(f"--slots {args.slots} must be a multiple of the mesh's data x "
                                f"fsdp = {placement.batch_shards}")
    return dc


def decoder_kwargs(args, placement: "Placement", capacity: int) -> dict:
    """The Decoder's settings from a door's options: one construction for every door."""
    return dict(method=args.method, window=args.window, slots=args.slots, capacity=capacity,
                steps_per_call=args.steps_per_call, refill=args.refill,
                prefill_chunk=args.prefill_chunk, allow_long=args.allow_long,
                page_size=placement.page_size, num_pages=placement.num_pages,
                mask_token_id=args.mask_token_id, dtype=placement.dtype,
                attention=placement.attention, kv_tile=placement.kv_tile)
