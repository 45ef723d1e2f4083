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
             the output equals `ar` (decode/engine/step/verified.py).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Sequence

from decode.options import (DOORS, INT32_MAX, MAX_STOP_IDS, Checked, DecodeConfigError,  # noqa: F401
                            OnDevice, add_option_arguments, check_float, check_int, check_value,
                            is_int, option)

from decode.lora_options import LoraOptions
from wedlm_jax.dtypes import DtypeError, dtype_name
from wedlm_jax import quantize_scheme as scheme_rules
from wedlm_jax.attention.table import KV_DTYPES
from wedlm_jax.attention.table import CACHE_CHOICES
from wedlm_jax.axis_rules import MESH_AXES
from wedlm_jax.config import ConfigError, ModelConfig

METHODS = ("streaming", "block", "ar", "verified")
CONSTRAINT_BACKENDS = ("auto", "device", "host")   # decode.constraints.backends
WINDOW_POLICIES = ("fixed", "load")              # decode.engine.runtime.window_policy
# the device tables' one shape (states, token classes): every constrained request's automaton is
# padded to it, so one set of programs serves every constraint; a larger one takes the host
DEVICE_TABLE = (512, 512)
REFILLS = ("before", "after")               # decode.engine.step.steps: when the window's masks are refilled
SAMPLING_ORDERS = ("filter_first", "temper_first")   # decode.engine.step.sampling: filter vs temperature
MAX_LOGPROBS = 20       # top alternatives per token (OpenAI's and vLLM's limit)
SEED_MAX = 2**32 - 1    # a request's seed is a uint32
DECODE_ONLY = ("wedlm-decode",)   # options wedlm-serve takes with each request only
# The widest window W: a forward holds up to 2W slots (refill 'before'), so a wider window only
# adds masked slots to every forward: slower steps, no more tokens per forward.
MAX_WINDOW = 256


# ------------------------------------------------------------------------------ the options
#
# Every decoding option is defined once, as a field of one of the options types below, with its
# default, kind, bounds, help, doors, wire name and device form (`option`, decode/options.py).
# Two kinds of options:
#   compile time   Method (method, W, refill, prefill chunk) + EngineOptions (slots, steps per
#                  call, capacity, ...) + Placement (dtype, mesh, attention backend, KV tile,
#                  pages): what the Decoder's programs are built for;
#   per request    Sampling (its fields below are the list, `Sampling.options()`): runtime
#                  values, one set per request, on the device as the decode state's
#                  `SlotSettings` (decode/engine/step/state.py).


def _stop_row(ids) -> list:
    return list(ids) + [-1] * (MAX_STOP_IDS - len(ids))


MAX_LOGIT_BIAS = 300    # logit_bias entries per request (OpenAI's limit): a fixed-size device row
LOGIT_BIAS_MAX = 100.0  # a bias lies in [-100, 100] (OpenAI's range)


def _logit_bias(name: str, value) -> tuple:
    """{token id: bias} (JSON's string keys, a JSON text from the command line, or (id, bias)
    pairs) -> ((id, bias), ...) by id; ids are checked against the vocabulary by the Decoder."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise DecodeConfigError(f"{name} must be a JSON object of token id: bias, got "
                                    f"{value!r}", name) from None
    pairs = value.items() if isinstance(value, dict) else value
    if isinstance(pairs, (bytes, numbers.Number)) or not hasattr(pairs, "__iter__"):
        raise DecodeConfigError(f"{name} must map token ids to biases, got {value!r}", name)
    out = {}
    for pair in pairs:
        key, bias = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (pair, None)
        tid = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not is_int(tid) or not 0 <= tid <= INT32_MAX:
            raise DecodeConfigError(f"{name}: key {key!r} is not a token id", name)
        try:
            out[int(tid)] = check_float(f"{name}[{tid}]", bias, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX)
        except DecodeConfigError as e:
            raise DecodeConfigError(str(e), name) from None
    if len(out) > MAX_LOGIT_BIAS:
        raise DecodeConfigError(f"{name}: at most {MAX_LOGIT_BIAS} entries, got {len(out)}", name)
    return tuple(sorted(out.items()))


def _bias_row(pairs, at: int) -> list:
    """Field `at` (0: ids, padded with -1; 1: biases, padded with 0) of a logit_bias, one row."""
    pad = (-1, 0.0)[at]
    return [p[at] for p in pairs] + [pad] * (MAX_LOGIT_BIAS - len(pairs))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling(Checked):
    """A request's sampling settings (runtime values: changing them never recompiles).
    docs/algorithm.md §3 (tau, lambda) and §5 (the sampling of a committed token)."""
    tau: float = option(0.4, float, "commit every window slot whose adjusted entropy is below tau",
                        low=0.0, wire=True, device=OnDevice("float32"))
    lam: float = option(0.02, float, "lambda: the distance penalty added to a slot's entropy per "
                                     "position it lies past the first undecided one", low=0.0,
                        wire=True, device=OnDevice("float32"))
    temperature: float = option(0.0, float, "0: greedy; > 0: sample the committed tokens", low=0.0,
                                doors=DECODE_ONLY, wire=True, device=OnDevice("float32"))
    top_k: int = option(0, int, "sample among the k likeliest (0: all)", low=0, doors=DECODE_ONLY,
                        wire=True, device=OnDevice("int32"))
    top_p: float = option(1.0, float, "nucleus mass in (0, 1] (1: all)", low=0.0, high=1.0,
                          low_open=True, doors=DECODE_ONLY, wire=True, device=OnDevice("float32"))
    sampling_order: str = option("filter_first", str, "filter_first is the official engine's "
                                 "(top-k, top-p, then temperature), temper_first transformers'",
                                 choices=SAMPLING_ORDERS, wire=True,
                                 device=OnDevice("bool", "temper_first",
                                                 encode=lambda v: v == "temper_first"))
    min_p: float = option(0.0, float, "keep the tokens at least min_p x as likely as the likeliest "
                          "(in the domain of top-p; 0: off)", low=0.0, high=1.0,
                          doors=DECODE_ONLY, wire=True, device=OnDevice("float32"))
    presence_penalty: float = option(0.0, float, "subtracted from the logit of every token the "
                                     "request generated already", low=-2.0, high=2.0,
                                     doors=DECODE_ONLY, wire=True, device=OnDevice("float32"))
    frequency_penalty: float = option(0.0, float, "subtracted from a token's logit once per time "
                                      "the request generated it", low=-2.0, high=2.0,
                                      doors=DECODE_ONLY, wire=True, device=OnDevice("float32"))
    repetition_penalty: float = option(1.0, float, "a generated token's positive logit divided by "
                                       "it, a negative one multiplied (1: off)", low=0.0,
                                       low_open=True, doors=DECODE_ONLY, wire=True,
                                       device=OnDevice("float32"))
    logit_bias: tuple = option((), _logit_bias, f"{{token id: bias in [-100, 100]}} added to the "
                               f"logits (at most {MAX_LOGIT_BIAS})", doors=(), wire=True,
                               device=(OnDevice("int32", "bias_ids", MAX_LOGIT_BIAS,
                                                encode=lambda v: _bias_row(v, 0)),
                                       OnDevice("float32", "bias_values", MAX_LOGIT_BIAS,
                                                encode=lambda v: _bias_row(v, 1))))
    max_new_tokens: int = option(256, int, "tokens to generate per request", low=1)
    stop_token_ids: tuple = option((), "ids", f"token ids that end a request (at most {MAX_STOP_IDS})",
                                   doors=(), device=OnDevice("int32", "stop_ids", MAX_STOP_IDS,
                                                             encode=_stop_row))
    seed: int = option(0, int, "sampling seed, in [0, 2**32)", low=0, high=SEED_MAX,
                       doors=DECODE_ONLY, wire=True, device=OnDevice("uint32"))

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0


# prompt tokens per prefill forward: at 512 rows the 8B forward is compute-bound on an H100
# (at 128 each chunk re-reads every weight for a quarter of the work: the weights' bytes bound
# a 2K prompt's admission to a third of the card's matmul rate)
PREFILL_CHUNK = 512

@dataclasses.dataclass(frozen=True, kw_only=True)
class Method(Checked):
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
    constraint_backend: str = option("auto", str, "structured outputs: device (the automaton's "
                                     "tables in the decode loop), host (llguidance's parser, "
                                     "asked once a step) or auto (device where its tables are "
                                     "exact and ready in time)", choices=CONSTRAINT_BACKENDS)
    window_policy: str = option("fixed", str, "the window each device call steps with: fixed (the "
                                "method's window) or load (a rung of the window ladder W, W/2, ... "
                                "chosen per call from the live requests and the step times "
                                "measured; verified's output is AR's on every rung, streaming's "
                                "depends on the rungs it ran)", choices=WINDOW_POLICIES)

    def __post_init__(self):
        super().__post_init__()
        if self.window_policy == "load" and self.method in ("ar", "block"):
            raise DecodeConfigError(f"--window-policy load needs a window ladder: method "
                                    f"{self.method!r} has one window (use streaming or "
                                    f"verified)", "window_policy")


def useful_window(window: int, method: str, longest_budget: int) -> int:
    """The window a decoding is built with: W, but no wider than the longest budget
    (max_new_tokens) it serves (slots past it are never committed), one more for `verified`
    (its windows start at the pending token)."""
    return max(1, min(window, longest_budget + (method == "verified")))


def prompt_problem(ids: Sequence, vocab_size: int | None,
                   capacity: int | None = None) -> str | None:
    """What keeps token ids from being a prompt, in the words of every door: the first that is no
    token id in the vocabulary (when `vocab_size` is given), or more ids than `capacity` (when
    given); None when nothing."""
    for t in ids:
        if vocab_size is not None and not (is_int(t) and 0 <= t < vocab_size):
            return f"token id {t!r} is outside the vocabulary [0, {vocab_size})"
    if capacity is not None and len(ids) > capacity:
        return f"{len(ids)} tokens, longer than the capacity {capacity}"
    return None


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
        problem = prompt_problem(ids, vocab_size, capacity)
        if problem:
            raise DecodeConfigError(f"prompt {i}: {problem}")
        out.append(ids)
    return out


def mask_id_for(config: ModelConfig, given: int | None, method: str, *, tokenizer=None,
                source: str = "the model config", name: str = "mask_token_id",
                announce=None) -> int:
    """The [MASK] id to decode with, the one rule of every door and of the plan: `given` (the
    option `name`, checked against the vocabulary), else the rule training shares
    (`wedlm_jax.tokenizer.mask_token_rule`: the config's, the released checkpoints' for a `wedlm`
    config with null — `announce`d once —, the `tokenizer`'s); AR decoding reads none (0).
    DecodeConfigError naming mask_token_id when a window method finds none or the id lies
    outside the vocabulary."""
    if given is not None:
        if not is_int(given) or not 0 <= int(given) < config.vocab_size:
            raise DecodeConfigError(f"{name} {given!r} is outside the vocabulary "
                                    f"[0, {config.vocab_size})", "mask_token_id")
        return int(given)
    if method == "ar":
        return 0
    from wedlm_jax.tokenizer import mask_token_rule
    try:
        mask, origin = mask_token_rule(config, tokenizer, source, "mask_token_id=ID / --mask-token-id ID")
    except ConfigError as e:
        raise DecodeConfigError(str(e), "mask_token_id") from None
    if mask is None:
        raise DecodeConfigError(
            f"method {method!r} needs a mask token id: {source} has no mask_token_id"
            f"{'' if tokenizer is None else ', the tokenizer no mask token'} and none was given "
            "(pass mask_token_id=... / --mask-token-id)", "mask_token_id")
    if origin == "released" and announce is not None:
        announce(f"{source} has mask_token_id null: decoding with [MASK] id {mask}, as the official "
                 f"WeDLM engine does (--mask-token-id overrides)")
    return mask


# ------------------------------------------------------------------------------- placement

WEIGHT_LAYOUTS = ("auto", "compiler", "default")                   # decode/engine/planning/layouts.py


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


def _mesh(name: str, value) -> tuple:
    """A mesh given as text ('data=2,tensor=4', the flag) or as (data, fsdp, tensor)."""
    if isinstance(value, str):
        return parse_mesh(value)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 3:
        raise DecodeConfigError(f"mesh must be (data, fsdp, tensor), got {value!r}", name)
    for axis, n in zip(MESH_AXES, value):
        check_int(f"mesh {axis}", n, 1)
    return tuple(int(n) for n in value)


def _dtype(name: str, value) -> str:
    try:
        return dtype_name(value)
    except DtypeError as e:
        raise DecodeConfigError(str(e), name) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement(Checked):
    """Where and how the weights and the cache live, the same at every door (wedlm-decode, the
    batch job, wedlm-serve): compute/storage dtype, the ('data', 'fsdp', 'tensor') mesh (slots
    over data x fsdp, heads over tensor), the cache-attention backend and its KV tile, the pages,
    the weights' layout and quantization, the KV cache's storage. Each a flag of the same name."""
    dtype: str = option("float32", _dtype, "weights, activations and KV cache: float32 or bfloat16 "
                                           "(f32, bf16)")
    mesh: tuple = option((1, 1, 1), _mesh, "devices as AXIS=N over data, fsdp, tensor (e.g. "
                         "tensor=4: heads over 4 devices; data=2: slots over 2); (1, 1, 1): one device")
    attention: str = option("auto", str, "cache-attention backend; auto: on GPU the Triton kernel "
                            "reading the cache in place (pallas, the live rows split over the "
                            "card's cores), on TPU and CPU the tiled XLA path",
                            choices=CACHE_CHOICES)
    kv_tile: int = option(256, int, "KV cache rows per attention tile (tiled, pallas)", low=1)
    page_size: int | None = option(
        None, int, "a paged KV cache shared by the slots, pages of this many rows, with "
        "prompt-prefix reuse (--input and wedlm-serve); 0: each slot reserves its capacity; "
        "default: pages of 64 on TPU (the ragged kernel moves fewer bytes per step; it reads "
        "head_dim multiples of 128 only, other models take 0 there); for "
        "wedlm-serve and --input pages of 64 on GPU (the Triton paged kernel) and of 16 on CPU "
        "(live-slot steps, prefix reuse); each slot its capacity for a static batch off TPU",
        low=0, optional=True)
    num_pages: int | None = option(None, int, "the paged cache's pages (default: slots x pages of "
                                   "one sequence at the capacity)", low=1, optional=True)
    weight_layout: str = option(
        "auto", str, "compiler: the weights in the layouts the compiled decode step picks (no "
        "relayout copies inside each step); default: row-major as loaded; auto: compiler on TPU, "
        "default elsewhere (decode/engine/planning/layouts.py)", choices=WEIGHT_LAYOUTS, flag_choices=True)
    quantize: str = option(
        "none", str, "weight-only quantization of the projections: int8 (a scale per output "
        "channel) or int4 (a scale per --quantize-group inputs); the embedding and LM head int8 "
        "under both (a scale per token)", choices=scheme_rules.SCHEMES, flag_choices=True)
    quantize_group: int | None = option(
        None, int, "the group size along each projection's input (default: int4 "
        f"{scheme_rules.DEFAULT_GROUP['int4']}, int8 per channel; 0: per channel)", low=0,
        optional=True)
    kv_dtype: str = option(
        "auto", str, "the KV cache: auto (in --dtype) or int8 (a float32 scale per token and head "
        "beside its int8 row; read by the XLA attention paths: --attention tiled or dense, the "
        "paged gather path)", choices=KV_DTYPES, flag_choices=True)

    def __post_init__(self):
        try:   # the scheme and its group together, with the scheme's words
            scheme_rules.resolve_group(self.quantize, self.quantize_group)
        except scheme_rules.QuantizeError as e:
            raise DecodeConfigError(str(e), e.field) from None
        super().__post_init__()
        if self.num_pages is not None and not self.page_size:
            raise DecodeConfigError("--num-pages needs --page-size (a paged cache)", "num_pages")

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

    def check_model(self, config) -> int:
        """This placement against the model's shapes, the one check of both: heads and KV heads
        split over the mesh's `tensor`, the quantization group dividing every projection's input
        axis. Returns the group size (wedlm_jax.quantize); DecodeConfigError naming the setting."""
        t = self.mesh[2]
        if config.num_kv_heads % t or config.num_heads % t:
            raise DecodeConfigError(f"--mesh tensor={t} does not divide the model's "
                                    f"{config.num_heads} heads / {config.num_kv_heads} KV heads")
        try:
            return scheme_rules.check_model(config, self.quantize, self.quantize_group)
        except scheme_rules.QuantizeError as e:
            raise DecodeConfigError(str(e), e.field) from None

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("placement (the same for wedlm-decode, the batch job and "
                                      "wedlm-serve)")
        add_option_arguments(g, cls, cls.options())

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

    @staticmethod
    def check_dry_run_flags(args) -> None:
        """--topology and --device-memory without --dry-run would be ignored: refused, naming
        both flags (one DecodeConfigError)."""
        if args.dry_run:
            return
        for flag, value in (("--topology", args.topology), ("--device-memory", args.device_memory)):
            if value is not None:
                raise DecodeConfigError(f"{flag} goes with --dry-run (compile the programs for an "
                                        f"accelerator); without --dry-run it would be ignored: add "
                                        f"--dry-run or drop {flag}")

    @classmethod
    def from_args(cls, args) -> "Placement":
        return cls(**cls.pick(args))


def check_slots(slots: int, shards: int, name: str = "slots") -> None:
    """Slots split evenly over the mesh's data x fsdp shards; DecodeConfigError naming `name`."""
    if slots % shards:
        raise DecodeConfigError(f"{name} {slots} must be a multiple of the mesh's data x fsdp = "
                                f"{shards}", "slots")


# ------------------------------------------------------------------------- the doors' options

SERVE_CAPACITY = 2048     # wedlm-serve's default capacity (wedlm-decode sizes it from its prompts)
ENGINE_FLAGS = tuple(EngineOptions.options())
# the per-request settings a door takes on its command line (on the server, every request's
# defaults; the server takes the others with each request, the batch job also per line)
SAMPLING_FLAGS = {door: Sampling.flag_names(door) for door in DOORS}


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
                         notes={"slots": only_input, "steps_per_call": only_input, "window_policy": only_input,
                                "capacity": "" if serve else "; default: the longest prompt + its "
                                                             "new tokens"})
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="the [MASK] id (default: config.json's, else the tokenizer's <|mask|>)")
    g.add_argument("--no-default-stops", action="store_true",
                   help="do not stop at eos / <|im_end|> from the tokenizer and generation_config.json")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template in place of the checkpoint's own (e.g. one that "
                        "renders tools: configs/chat_templates/hermes.jinja, llama3_json.jinja)")
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
    lora: LoraOptions = LoraOptions()     # decode/lora_options.py

    @classmethod
    def from_args(cls, args) -> "DoorOptions":
        """From `add_decoding_arguments` + `Placement.add_arguments`' flags; a DecodeConfigError
        naming the option otherwise."""
        engine, sampling = EngineOptions(**EngineOptions.pick(args)), Sampling(**Sampling.pick(args))
        placement = Placement.from_args(args)
        check_slots(engine.slots, placement.batch_shards, "--slots")
        return cls(engine, sampling, placement, LoraOptions.from_args(args))

    @property
    def decode_config(self) -> DecodeConfig:
        """The static batch's settings (wedlm-decode --prompt / --prompts-file)."""
        return DecodeConfig(**Method.pick(self.engine), **Sampling.pick(self.sampling))
