"""Decoding options, each defined once (default, bounds, help) and checked on construction, before
anything compiles: `Sampling` (a request's runtime settings), `Method` and `EngineOptions` (what the
programs are built for), `Placement` (dtype, mesh, attention backend, pages), `DecodeConfig` (a
static batch: Method + Sampling) and `DoorOptions` (what a command-line door was given).

Names follow docs/algorithm.md §3 and the paper: `window` (W), `tau` (entropy threshold), `lam`
(distance penalty lambda). Methods:

  streaming  the paper's Algorithm 1 (reorder, forward, commit the leading filled run, fill, slide);
  block      stop-and-wait block decoding: a block of W masks is resolved with the same fill rule and
             committed whole (one forward in natural order) only once every slot is filled;
  ar         ordinary cached next-token decoding (the AR reading of the same network);
  verified   streaming drafts whose commits are verified by the AR reading of the same forward:
             the output equals `ar` (decode/engine/verified.py).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

from wedlm_jax.dtypes import DtypeError, dtype_name
from wedlm_jax import quantize as quantize_lib
from wedlm_jax.attention.kv_quant import KV_DTYPES
from wedlm_jax.sharding import MESH_AXES

METHODS = ("streaming", "block", "ar", "verified")
REFILLS = ("before", "after")               # decode.engine.steps: when the window's masks are refilled
SAMPLING_ORDERS = ("filter_first", "temper_first")   # decode.engine.sampling: filter vs temperature
MAX_STOP_IDS = 16  # stop ids travel as a fixed-size runtime array (padded with -1): no recompile per set
INT32_MAX = 2**31 - 1   # integer settings travel as int32 on the device
SEED_MAX = 2**32 - 1    # a request's seed is a uint32
MAX_LOGPROBS = 20       # top alternatives per token (OpenAI's and vLLM's limit)
# The widest window W: a forward holds up to 2W slots (refill 'before'), so a wider window only
# adds masked slots to every forward: slower steps, no more tokens per forward.
MAX_WINDOW = 256


class DecodeConfigError(ValueError):
    """A decoding setting or input that the engine cannot honour; `field` is the setting at fault
    (as the door that checked it calls it) when one is."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# ------------------------------------------------------------------------------ the options
#
# Every decoding option is defined once, as a field of one of the options types below, with its
# default, kind, bounds and help (`option`). The same definition checks the value (`check_value`,
# on construction of every options type) and makes the doors' command-line flags
# (`add_option_arguments`); the server and the batch job read a request's values into the same
# types. Two kinds of options:
#   compile time   Method (method, W, refill, prefill chunk) + EngineOptions (slots, steps per
#                  call, capacity, ...) + Placement (dtype, mesh, attention backend, KV tile,
#                  pages): what the Decoder's programs are built for;
#   per request    Sampling (tau, lambda, temperature, top-k, top-p, sampling order, max new
#                  tokens, stop ids, seed): runtime values, one set per request.


def option(default, kind, help: str, *, low=None, high=None, low_open: bool = False,
           choices: tuple = (), optional: bool = False):
    """One option's definition: `kind` is int, float, str (one of `choices`), bool or 'ids' (stop
    token ids); numbers lie in [low, high] ((low, high] with low_open; ints default high int32);
    `optional`: None is allowed (the door decides)."""
    return dataclasses.field(default=default, metadata=dict(
        kind=kind, help=help, low=low, high=high, low_open=low_open, choices=tuple(choices),
        optional=optional))


def check_value(name: str, value, meta):
    """`value` checked against an option's definition and normalised (NumPy scalars to Python
    numbers, stop ids to a tuple without repeats); a DecodeConfigError naming `name` otherwise."""
    kind = meta["kind"]
    if value is None and meta["optional"]:
        return None
    if kind == "ids":
        return _stop_ids(name, value)
    if kind is str:
        if value not in meta["choices"]:
            raise DecodeConfigError(f"{name} {value!r} is unknown; allowed: {', '.join(meta['choices'])}",
                                    name)
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise DecodeConfigError(f"{name} must be true or false, got {value!r}", name)
        return value
    low, high = meta["low"], meta["high"]
    if kind is int:
        check_int(name, value, low, INT32_MAX if high is None else high)
        return int(value)
    ok = _is_number(value) and float(value) != float("inf")
    if ok:
        v = float(value)
        ok = (v > low if meta["low_open"] else v >= low) and (high is None or v <= high)
    if not ok:
        if high is None:
            raise DecodeConfigError(f"{name} must be a finite number >= {low:g}, got {_shown(value)}",
                                    name)
        raise DecodeConfigError(f"{name} must be in {'(' if meta['low_open'] else '['}{low:g}, {high:g}], "
                                f"got {_shown(value)}", name)
    return float(value)


def _stop_ids(name: str, value) -> tuple:
    stops = (value,) if is_int(value) else value
    if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
        raise DecodeConfigError(f"{name} must be a list of token ids, got {value!r}", name)
    stops = tuple(stops)
    for s in stops:
        if not is_int(s) or not 0 <= s <= INT32_MAX:
            raise DecodeConfigError(f"{name} must be ints in [0, {INT32_MAX}], got {s!r}", name)
    stops = tuple(dict.fromkeys(int(s) for s in stops))
    if len(stops) > MAX_STOP_IDS:
        raise DecodeConfigError(f"{name}: at most {MAX_STOP_IDS}, got {len(stops)}", name)
    return stops


class _Checked:
    """Checks (and normalises) every field defined with `option` on construction."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if "kind" in f.metadata:
                object.__setattr__(self, f.name, check_value(f.name, getattr(self, f.name), f.metadata))

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    @classmethod
    def options(cls) -> dict:
        """{name: its definition} of the options this type holds."""
        return {f.name: f for f in dataclasses.fields(cls) if "kind" in f.metadata}

    @classmethod
    def pick(cls, source) -> dict:
        """The values of this type's options found in `source` (an object's attributes, e.g. an
        argparse namespace or another options type, or a mapping)."""
        get = source.get if isinstance(source, dict) else lambda k, d: getattr(source, k, d)
        missing = object()
        return {k: v for k in cls.options() if (v := get(k, missing)) is not missing}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling(_Checked):
    """A request's sampling settings (runtime values: changing them never recompiles).
    docs/algorithm.md §3 (tau, lambda) and §5 (the sampling of a committed token)."""
    tau: float = option(0.4, float, "commit every window slot whose adjusted entropy is below tau",
                        low=0.0)
    lam: float = option(0.02, float, "lambda: the distance penalty added to a slot's entropy per "
                                     "position it lies past the first undecided one", low=0.0)
    temperature: float = option(0.0, float, "0: greedy; > 0: sample the committed tokens", low=0.0)
    top_k: int = option(0, int, "sample among the k likeliest (0: all)", low=0)
    top_p: float = option(1.0, float, "nucleus mass in (0, 1] (1: all)", low=0.0, high=1.0,
                          low_open=True)
    sampling_order: str = option("filter_first", str, "filter_first is the official engine's "
                                 "(top-k, top-p, then temperature), temper_first transformers'",
                                 choices=SAMPLING_ORDERS)
    max_new_tokens: int = option(256, int, "tokens to generate per request", low=1)
    seed: int = option(0, int, "sampling seed, in [0, 2**32)", low=0, high=SEED_MAX)
    stop_token_ids: tuple = option((), "ids", f"token ids that end a request (at most {MAX_STOP_IDS})")

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0


# prompt tokens per prefill forward: at 512 rows the 8B forward is compute-bound on an H100
# (at 128 each chunk re-reads every weight for a quarter of the work: the weights' bytes bound
# a 2K prompt's admission to a third of the card's matmul rate)
PREFILL_CHUNK = 512

@dataclasses.dataclass(frozen=True, kw_only=True)
class Method(_Checked):
    """How the programs decode (compile time): docs/algorithm.md §3-4."""
    method: str = option("streaming", str, "the decoding method", choices=METHODS)
    window: int = option(16, int, f"W: undecided slots in the window (limited to the budget; at "
                         f"most {MAX_WINDOW})", low=1, high=MAX_WINDOW)
    refill: str = option("before", str, "when the window's masks are refilled: 'before' is the "
                         "official engine's order (up to 2W slots a forward, up to W tokens a "
                         "forward), 'after' docs/algorithm.md's (W slots, up to W/2 tokens)",
                         choices=REFILLS)
    prefill_chunk: int = option(PREFILL_CHUNK, int, "prompt tokens per prefill forward (the last "
                                "chunk of a prompt is computed whole, padding included)", low=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig(Method, Sampling):
    """A static batch's settings (decode.static.static_batch.generate): the Method and one Sampling for
    every prompt. Fields follow docs/algorithm.md §3 and the paper's names: `window` (W), `tau`
    (entropy threshold), `lam` (distance penalty lambda)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions(Method):
    """What a continuous-batching Decoder is built for besides the Method (compile time; the
    Placement holds the device side)."""
    slots: int = option(16, int, "requests decoded at once", low=1)
    steps_per_call: int = option(8, int, "decode steps per device call (a chunk; a call ends "
                                 "sooner once every request just admitted has its first tokens)",
                                 low=1)
    capacity: int | None = option(None, int, "cache capacity per request (prompt + generated "
                                  "tokens)", low=1, optional=True)
    allow_long: bool = option(False, bool, "allow a capacity past the model's "
                              "max_position_embeddings")


def useful_window(window: int, method: str, longest_budget: int) -> int:
    """The window a decoding is built with: W, but no wider than the longest budget
    (max_new_tokens) it serves (slots past it are never committed), one more for `verified`
    (its windows start at the pending token)."""
    return max(1, min(window, longest_budget + (method == "verified")))


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _shown(value) -> str:
    """A value as the doors quote it: numbers alike whether they came as text (argparse: -1.0) or
    JSON (-1); anything else by repr."""
    if is_int(value):
        return str(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{float(value):g}"
    return repr(value)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x  # rejects NaN


def check_int(name, value, low, high=INT32_MAX):
    """A DecodeConfigError naming `name` unless `value` is an int in [low, high] (int32 by
    default: integer settings travel as int32 on the device)."""
    if not is_int(value) or not low <= value <= high:
        raise DecodeConfigError(f"{name} must be an int in [{low}, {high}], got "
                                f"{_shown(value) if is_int(value) else repr(value)}", name)


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


# ------------------------------------------------------------------------------- placement

CACHE_ATTENTION = ("auto", "tiled", "dense", "pallas", "cudnn")   # wedlm_jax.attention.backends
WEIGHT_LAYOUTS = ("auto", "compiler", "default")                   # decode/engine/layouts.py


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
    page_size: int | None = None    # a paged KV cache of pages of this many rows (None: the
                                    # platform's choice, attention.paged.auto_page_size; 0: dense)
    num_pages: int | None = None    # the paged cache's pages per layer (None: slots x per sequence)
    weight_layout: str = "auto"     # decode/engine/layouts.py: compiler | default | auto (compiler on TPU)
    quantize: str = "none"          # weight-only: none | int8 | int4 (wedlm_jax/quantize.py)
    quantize_group: int | None = None   # its group size (None: the scheme's; 0: per channel)
    kv_dtype: str = "auto"          # the KV cache: auto (the dtype) | int8 (wedlm_jax/attention/kv_quant.py)

    def __post_init__(self):
        try:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        except DtypeError as e:
            raise DecodeConfigError(str(e), "dtype") from None
        if len(self.mesh) != 3:
            raise DecodeConfigError(f"mesh must be (data, fsdp, tensor), got {self.mesh!r}")
        for name, n in zip(MESH_AXES, self.mesh):
            check_int(f"mesh {name}", n, 1)
        if self.attention not in CACHE_ATTENTION:
            raise DecodeConfigError(f"attention {self.attention!r} is unknown; allowed: "
                                    f"{', '.join(CACHE_ATTENTION)}")
        check_int("kv_tile", self.kv_tile, 1)
        if self.page_size is not None:
            check_int("page_size", self.page_size, 0)
        if self.num_pages is not None:
            if not self.page_size:
                raise DecodeConfigError("--num-pages needs --page-size (a paged cache)")
            check_int("num_pages", self.num_pages, 1)
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise DecodeConfigError(f"weight_layout {self.weight_layout!r} is unknown; allowed: "
                                    f"{', '.join(WEIGHT_LAYOUTS)}", "weight_layout")
        try:
            quantize_lib.resolve_group(self.quantize, self.quantize_group)
        except quantize_lib.QuantizeError as e:
            raise DecodeConfigError(str(e), e.field) from None
        if self.kv_dtype not in KV_DTYPES:
            raise DecodeConfigError(f"kv_dtype {self.kv_dtype!r} is unknown; allowed: "
                                    f"{', '.join(KV_DTYPES)}", "kv_dtype")

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
        check_quantize(config, self)

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
                       help=f"cache-attention backend: one of {', '.join(CACHE_ATTENTION)}; "
                            "auto: on GPU the Triton kernel reading the cache in place (pallas, "
                            "the live rows split over the card's cores), on TPU and CPU the "
                            "tiled XLA path")
        g.add_argument("--kv-tile", type=int, default=d.kv_tile,
                       help="KV cache rows per attention tile (tiled, pallas)")
        g.add_argument("--page-size", type=int, default=None,
                       help="a paged KV cache shared by the slots, pages of this many rows, with "
                            "prompt-prefix reuse (--input and wedlm-serve); 0: each slot reserves "
                            "its capacity; default: pages of 64 on TPU (the ragged kernel moves "
                            "fewer bytes per step; it reads head_dim multiples of 128 only, "
                            "other models take 0 there); for wedlm-serve and --input pages of 64 "
                            "on GPU (the Triton paged kernel) and of 16 on CPU (live-slot steps, "
                            "prefix reuse); each slot its capacity for a static batch off TPU")
        g.add_argument("--num-pages", type=int, default=None,
                       help="the paged cache's pages (default: slots x pages of one sequence at "
                            "the capacity)")
        g.add_argument("--weight-layout", default=d.weight_layout, choices=WEIGHT_LAYOUTS,
                       help="compiler: the weights in the layouts the compiled decode step picks "
                            "(no relayout copies inside each step); default: row-major as loaded; "
                            "auto: compiler on TPU, default elsewhere")
        g.add_argument("--quantize", default=d.quantize, choices=quantize_lib.SCHEMES,
                       help="weight-only quantization of the projections: int8 (a scale per "
                            "output channel) or int4 (a scale per --quantize-group inputs); "
                            "the embedding and LM head int8 under both (a scale per token)")
        g.add_argument("--quantize-group", type=int, default=None,
                       help="the group size along each projection's input (default: int4 "
                            f"{quantize_lib.DEFAULT_GROUP['int4']}, int8 per channel)")
        g.add_argument("--kv-dtype", default=d.kv_dtype, choices=KV_DTYPES,
                       help="the KV cache: auto (in --dtype) or int8 (a float32 scale per token "
                            "and head beside its int8 row; read by the XLA attention paths: "
                            "--attention tiled or dense, the paged gather path)")

    @staticmethod
    def add_dry_run_arguments(parser, who: str) -> None:
        """`--dry-run --topology T [--device-memory GiB]` (decode.compile.aot.dry_run_door): the door's
        programs compiled for an accelerator from config.json alone."""
        d = parser.add_argument_group(f"dry run: compile {who}'s programs for an accelerator from "
                                      "config.json alone (no weights, no accelerator) and say if "
                                      "they fit")
        d.add_argument("--dry-run", action="store_true")
        d.add_argument("--topology", help="a TPU topology libtpu describes (v5e:2x4, "
                                          "tpu:v5p:2x2x2) or GPUs XLA's GPU compiler targets "
                                          "(h100, h100:8)")
        d.add_argument("--device-memory", type=float, default=None,
                       help="GiB per chip to fit in (default: the chip's HBM)")

    @classmethod
    def from_args(cls, args) -> "Placement":
        return cls(dtype=args.dtype, mesh=parse_mesh(args.mesh), attention=args.attention,
                   kv_tile=args.kv_tile, page_size=getattr(args, "page_size", None),
                   num_pages=getattr(args, "num_pages", None),
                   weight_layout=getattr(args, "weight_layout", "auto"),
                   quantize=getattr(args, "quantize", "none"),
                   quantize_group=getattr(args, "quantize_group", None),
                   kv_dtype=getattr(args, "kv_dtype", "auto"))


def check_quantize(config, placement: Placement) -> int:
    """The placement's quantization group size, checked against the model's shapes (a group must
    divide every projection's input axis); DecodeConfigError naming the setting otherwise."""
    try:
        return quantize_lib.check_model(config, placement.quantize, placement.quantize_group)
    except quantize_lib.QuantizeError as e:
        raise DecodeConfigError(str(e), e.field) from None


# ------------------------------------------------------------------------- the doors' options

DOORS = ("wedlm-decode", "wedlm-serve")
SERVE_CAPACITY = 2048     # wedlm-serve's default capacity (wedlm-decode sizes it from its prompts)
ENGINE_FLAGS = ("method", "window", "refill", "slots", "steps_per_call", "capacity", "prefill_chunk",
                "allow_long")
# the per-request settings a door takes on its command line (on the server, every request's
# defaults; the server takes the others with each request, the batch job also per line)
SAMPLING_FLAGS = {"wedlm-decode": ("tau", "lam", "sampling_order", "max_new_tokens", "temperature",
                                   "top_k", "top_p", "seed"),
                  "wedlm-serve": ("tau", "lam", "sampling_order", "max_new_tokens")}


def add_option_arguments(group, cls, names, *, flags=None, defaults=None, notes=None) -> None:
    """One flag per option of `cls` in `names`: `--name-with-dashes` (or flags[name]), its default
    (the type's, or defaults[name]) and its help (its definition's, + notes[name]), all from the
    option's one definition."""
    base, defs = cls(), cls.options()
    for name in names:
        m = defs[name].metadata
        flag = (flags or {}).get(name, "--" + name.replace("_", "-"))
        text = m["help"] + (f" (one of {', '.join(m['choices'])})" if m["choices"] else "") \
            + (notes or {}).get(name, "")
        if m["kind"] is bool:
            group.add_argument(flag, dest=name, action="store_true", help=text)
            continue
        group.add_argument(flag, dest=name, type=m["kind"] if m["kind"] in (int, float) else str,
                           default=(defaults or {}).get(name, getattr(base, name)), help=text)


def add_decoding_arguments(parser, door: str) -> None:
    """The decoding options the doors share (wedlm-decode with its batch job, wedlm-serve): the
    compile-time group (EngineOptions: the Decoder's programs are built for these) and the
    per-request settings (Sampling; on the server, every request's defaults). `DoorOptions.from_args`
    checks them."""
    if door not in DOORS:
        raise ValueError(f"door must be one of {DOORS}, got {door!r}")
    serve = door == "wedlm-serve"
    g = parser.add_argument_group("decoding, compile-time (the programs are built for these)")
    only_input = "" if serve else " (--input)"
    add_option_arguments(g, EngineOptions, ENGINE_FLAGS,
                         defaults={"capacity": SERVE_CAPACITY} if serve else None,
                         notes={"slots": only_input, "steps_per_call": only_input,
                                "capacity": "" if serve else "; default: the longest prompt + its "
                                                             "new tokens"})
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="the [MASK] id (default: config.json's, else the tokenizer's <|mask|>)")
    g.add_argument("--no-default-stops", action="store_true",
                   help="do not stop at eos / <|im_end|> from the tokenizer and generation_config.json")
    r = parser.add_argument_group("per-request settings" + (" (a request's defaults)" if serve else ""))
    add_option_arguments(r, Sampling, SAMPLING_FLAGS[door],
                         flags={"max_new_tokens": "--max-tokens"} if serve else None)


@dataclasses.dataclass(frozen=True)
class DoorOptions:
    """A door's decoding options (wedlm-decode, its batch job, wedlm-serve), each checked once,
    before anything loads: the compile-time EngineOptions and Placement, and the per-request
    Sampling (the defaults of every request the door makes)."""
    engine: EngineOptions
    sampling: Sampling
    placement: Placement

    @classmethod
    def from_args(cls, args) -> "DoorOptions":
        """From `add_decoding_arguments` + `Placement.add_arguments`' flags; a DecodeConfigError
        naming the option otherwise."""
        engine, sampling = EngineOptions(**EngineOptions.pick(args)), Sampling(**Sampling.pick(args))
        placement = Placement.from_args(args)
        if engine.slots % placement.batch_shards:
            raise DecodeConfigError(f"--slots {engine.slots} must be a multiple of the mesh's data x "
                                    f"fsdp = {placement.batch_shards}", "slots")
        return cls(engine, sampling, placement)

    @property
    def decode_config(self) -> DecodeConfig:
        """The static batch's settings (wedlm-decode --prompt / --prompts-file)."""
        return DecodeConfig(**Method.pick(self.engine), **Sampling.pick(self.sampling))
