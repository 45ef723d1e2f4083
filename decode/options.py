"""The option machinery: every decoding option is defined once, as a field of an options type
(decode/config.py: Sampling, Method, EngineOptions, Placement) made with `option`, and that one
definition drives everything about it:

  the check      `check_value`, on construction of every options type (`Checked`);
  the flags      `add_option_arguments`: one command-line flag per option, its default and help;
                 `doors` names the commands whose command line takes it (DOORS);
  the wire       `wire=True`: a request body (wedlm-serve) or a batch-job line may set it under
                 its own name (`wire_names`);
  the device     `device=OnDevice(...)`: a runtime option travels to the decode loop as one value
                 per slot in the decode state's `SlotSettings` (decode/engine/step/state.py builds the
                 struct and its rows from these definitions, `device_fields`).

Adding a runtime sampling option is one `option(...)` field on Sampling and its use where the
device reads it (decode/engine/step/sampling.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
from typing import Callable

INT32_MAX = 2**31 - 1   # integer settings travel as int32 on the device
DOORS = ("wedlm-decode", "wedlm-serve")


class DecodeConfigError(ValueError):
    """A decoding setting or input that the engine cannot honour; `field` is the setting at fault
    (as the door that checked it calls it) when one is."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class OnDevice:
    """How a runtime option travels to the decode loop: a `SlotSettings` field (`name`, default the
    option's) of one `dtype` value per slot ([B]), or `width` values per slot ([B, width]), made
    from the option's value by `encode` (default: the value as is). A free slot holds the encoding
    of the option's default: its "off" value."""
    dtype: str
    name: str = ""
    width: int = 0
    encode: Callable | None = None


def option(default, kind, help: str, *, low=None, high=None, low_open: bool = False,
           choices: tuple = (), optional: bool = False, doors: tuple = DOORS, wire: bool = False,
           device=(), flag_choices: bool = False, nargs: str | None = None):
    """One option's definition: `kind` is int, float, str (one of `choices`), bool, 'ids' (stop
    token ids) or a function (name, value) -> the checked value; numbers lie in [low, high]
    ((low, high] with low_open; ints default high int32); `optional`: None is allowed (the door
    decides). `doors`: the commands whose flags take it; `wire`: a request may set it by name;
    `device`: an OnDevice (or a tuple of them) when it travels to the decode loop;
    `flag_choices`: the flag itself refuses other values (argparse); `nargs`: the flag takes
    several values (argparse's nargs)."""
    device = device if isinstance(device, tuple) else (device,)
    return dataclasses.field(default=default, metadata=dict(
        kind=kind, help=help, low=low, high=high, low_open=low_open, choices=tuple(choices),
        optional=optional, doors=tuple(doors), wire=wire, device=device,
        flag_choices=flag_choices, nargs=nargs))


def check_value(name: str, value, meta):
    """`value` checked against an option's definition and normalised (NumPy scalars to Python
    numbers, stop ids to a tuple without repeats); a DecodeConfigError naming `name` otherwise."""
    kind = meta["kind"]
    if value is None and meta["optional"]:
        return None
    if kind == "ids":
        return stop_ids(name, value)
    if callable(kind) and kind not in (int, float, str, bool):
        return kind(name, value)
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
    return check_float(name, value, low, high, meta["low_open"])


def check_float(name: str, value, low, high=None, low_open: bool = False) -> float:
    """`value` as a float in [low, high] ((low, high] with low_open; no upper bound when high is
    None), finite; a DecodeConfigError naming `name` otherwise."""
    ok = is_number(value) and abs(float(value)) != float("inf")
    if ok:
        v = float(value)
        ok = (v > low if low_open else v >= low) and (high is None or v <= high)
    if not ok:
        if high is None:
            raise DecodeConfigError(f"{name} must be a finite number {'>' if low_open else '>='} "
                                    f"{low:g}, got {shown(value)}", name)
        raise DecodeConfigError(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], "
                                f"got {shown(value)}", name)
    return float(value)


MAX_STOP_IDS = 16  # stop ids travel as a fixed-size runtime array (padded with -1): no recompile per set


def stop_ids(name: str, value) -> tuple:
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


class Checked:
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

    @classmethod
    def flag_names(cls, door: str) -> tuple:
        """The options a door's command line takes (their definitions' `doors`)."""
        return tuple(k for k, f in cls.options().items() if door in f.metadata["doors"])

    @classmethod
    def wire_names(cls) -> tuple:
        """The options a request (a server body, a batch-job line) may set by name."""
        return tuple(k for k, f in cls.options().items() if f.metadata["wire"])


def device_fields(cls) -> list:
    """[(option name, its default, OnDevice)] of the fields of `cls` that travel to the device,
    in field order (a plain dataclass field may also carry `metadata={"device": (OnDevice,)}`)."""
    out = []
    for f in dataclasses.fields(cls):
        for d in f.metadata.get("device", ()):
            out.append((f.name, f.default, d))
    return out


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The doors' --help: defaults shown once (an option whose help already says its default, or
    whose default is None: nothing added), the epilog's lines kept as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text.lower() or action.default is None:
            return text
        return super()._get_help_string(action)


def add_option_arguments(group, cls, names, *, flags=None, defaults=None, notes=None) -> None:
    """One flag per option of `cls` in `names`: `--name-with-dashes` (or flags[name]), its default
    (the type's, or defaults[name]) and its help (its definition's, + notes[name]), all from the
    option's one definition."""
    defs = cls.options()
    for name in names:
        m = defs[name].metadata
        flag = (flags or {}).get(name, "--" + name.replace("_", "-"))
        text = m["help"] + (f" (one of {', '.join(m['choices'])})"
                            if m["choices"] and not m["flag_choices"] else "") \
            + (notes or {}).get(name, "")
        if m["kind"] is bool:
            group.add_argument(flag, dest=name, action="store_true", help=text)
            continue
        extra = dict(choices=m["choices"]) if m["flag_choices"] else {}
        if m.get("nargs"):
            extra["nargs"] = m["nargs"]
        group.add_argument(flag, dest=name, type=m["kind"] if m["kind"] in (int, float) else str,
                           default=(defaults or {}).get(name, defs[name].default), help=text,
                           **extra)


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x  # rejects NaN


def shown(value) -> str:
    """A value as the doors quote it: numbers alike whether they came as text (argparse: -1.0) or
    JSON (-1); anything else by repr."""
    if is_int(value):
        return str(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{float(value):g}"
    return repr(value)


def check_int(name, value, low, high=INT32_MAX):
    """A DecodeConfigError naming `name` unless `value` is an int in [low, high] (int32 by
    default: integer settings travel as int32 on the device)."""
    if not is_int(value) or not low <= value <= high:
        raise DecodeConfigError(f"{name} must be an int in [{low}, {high}], got "
                                f"{shown(value) if is_int(value) else repr(value)}", name)
