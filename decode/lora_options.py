"""The LoRA serving options (vLLM's flag names), defined once for every door that takes them
(wedlm-serve, wedlm-decode's batch job): `--enable-lora`, `--lora-modules NAME=PATH ...`,
`--max-loras N` (adapter table rows besides the base) and `--max-lora-rank R` (the table's rank).
The table's shape is compile time (wedlm_jax.lora.table); which adapters fill it is not:
decode.engine.runtime.adapters loads and unloads them at run time.
"""

from __future__ import annotations

import dataclasses
import re

from decode.options import Checked, DecodeConfigError, add_option_arguments, option
from wedlm_jax.lora.spec import MAX_RANK

LORA_DOORS = ("wedlm-decode", "wedlm-serve")
DEFAULT_MAX_LORAS = 1        # vLLM's defaults
DEFAULT_MAX_RANK = 16
NAME = re.compile(r"[A-Za-z0-9_.:/@+-]{1,128}\Z")


def check_name(name, field: str = "lora_name") -> str:
    """An adapter's name as clients give it in `model`: 1-128 letters, digits or `_.:/@+-`;
    a DecodeConfigError naming `field` otherwise."""
    if not isinstance(name, str) or not NAME.match(name):
        raise DecodeConfigError(f"{field} must be 1-128 letters, digits or _.:/@+-, got "
                                f"{name!r}", field)
    return name


def _modules(name: str, value) -> tuple:
    """NAME=PATH items (a list, or one text of them separated by spaces) -> ((name, path), ...),
    names unique."""
    items = value.split() if isinstance(value, str) else list(value)
    out: dict = {}
    for item in items:
        if isinstance(item, (tuple, list)) and len(item) == 2:
            key, path = item
        else:
            key, sep, path = str(item).partition("=")
            if not sep or not path:
                raise DecodeConfigError(f"{name}: {item!r} is not NAME=PATH", name)
        check_name(key, name)
        if key in out:
            raise DecodeConfigError(f"{name}: the name {key!r} is given twice", name)
        out[key] = str(path)
    return tuple(out.items())


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraOptions(Checked):
    """Whether a door serves LoRA adapters, which at start, and the adapter table's shape."""
    enable_lora: bool = option(False, bool, "serve LoRA adapters: a request names one by its "
                               "`model` (several adapters and the base in one batch)",
                               doors=LORA_DOORS)
    lora_modules: tuple = option((), _modules, "adapters loaded at start, NAME=PATH (PEFT "
                                 "folders) separated by spaces", doors=LORA_DOORS, nargs="+")
    max_loras: int | None = option(None, int, f"adapters loaded at once (the table's rows; "
                                   f"default {DEFAULT_MAX_LORAS})", low=1, high=256,
                                   optional=True, doors=LORA_DOORS)
    max_lora_rank: int | None = option(None, int, f"the largest adapter rank served (every row "
                                       f"is padded to it; default {DEFAULT_MAX_RANK})", low=1,
                                       high=MAX_RANK, optional=True, doors=LORA_DOORS)

    def __post_init__(self):
        super().__post_init__()
        if not self.enable_lora:
            for key in ("lora_modules", "max_loras", "max_lora_rank"):
                if getattr(self, key):
                    raise DecodeConfigError(f"--{key.replace('_', '-')} goes with --enable-lora",
                                            key)
        if len(self.lora_modules) > self.rows:
            raise DecodeConfigError(f"--lora-modules names {len(self.lora_modules)} adapters, "
                                    f"more than --max-loras {self.rows}", "lora_modules")

    @property
    def rows(self) -> int:
        """The table's adapter rows (0 without --enable-lora)."""
        return (self.max_loras or DEFAULT_MAX_LORAS) if self.enable_lora else 0

    @property
    def rank(self) -> int:
        """The table's rank (0 without --enable-lora)."""
        return (self.max_lora_rank or DEFAULT_MAX_RANK) if self.enable_lora else 0

    def check_folders(self, base_name: str | None = None) -> None:
        """Each --lora-modules folder's adapter_config.json read (no tensors: the shapes are
        checked against the model when it loads): a DecodeConfigError naming the adapter and
        the option it cannot serve (the rank bound, DoRA, ...), or a name the base model has."""
        from wedlm_jax.lora.spec import LoraError
        from wedlm_jax.lora.peft import read_spec
        for name, path in self.lora_modules:
            if name == base_name:
                raise DecodeConfigError(f"--lora-modules {name}={path}: {name!r} is the base "
                                        "model's name", "lora_modules")
            try:
                read_spec(path, self.rank)
            except LoraError as e:
                raise DecodeConfigError(f"--lora-modules {name}: {e}", "lora_modules") from None

    def load_into(self, adapters) -> None:
        """Every --lora-modules adapter loaded into `adapters` (decode.engine.runtime.adapters.Adapters),
        a DecodeConfigError naming the one that does not fit the model."""
        for name, path in self.lora_modules:
            try:
                adapters.load(name, path)
            except DecodeConfigError as e:
                raise DecodeConfigError(f"--lora-modules {name}: {e}", "lora_modules") from None

    @classmethod
    def add_arguments(cls, parser, door: str) -> None:
        g = parser.add_argument_group("LoRA adapters (vLLM's flags)")
        add_option_arguments(g, cls, cls.flag_names(door))

    @classmethod
    def from_args(cls, args) -> "LoraOptions":
        given = cls.pick(args)
        if given.get("lora_modules") is None:
            given.pop("lora_modules", None)
        return cls(**given)
