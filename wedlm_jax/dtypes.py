"""The dtype names every door reads (train configs, decoding options, wedlm-convert): one table.

    dtype_name("bf16")        -> "bfloat16"     (a name or alias, or a numpy / jax dtype)
    dtype_name("fp8")         DtypeError: dtype 'fp8' is unknown; allowed: float32, bfloat16 (f32, fp32, bf16)
    jnp_dtype("f32")          -> jnp.float32

The canonical names are numpy's (`np.dtype(x).name`); `ALIASES` holds the short spellings.
"""

from __future__ import annotations

import numpy as np

NAMES = ("float32", "bfloat16")
ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16"}
DTYPE_ALIASES = {**{n: n for n in NAMES}, **ALIASES}   # every accepted spelling -> its name


class DtypeError(ValueError):
    """A dtype outside the table."""


def allowed(names=NAMES) -> str:
    """The names and their aliases, as an error message lists them."""
    short = [a for a, n in ALIASES.items() if n in names]
    return ", ".join(names) + (f" ({', '.join(short)})" if short else "")


def canonical(x) -> str | None:
    """The canonical name of `x` (a name or alias as spelled in the table, or a numpy / jax
    dtype), or None when it is neither a dtype of the table nor a spelling of one."""
    if isinstance(x, str):
        return DTYPE_ALIASES.get(x)
    try:
        name = np.dtype(x).name
    except TypeError:
        return None
    return name if name in NAMES else None


def dtype_name(x, names=NAMES, what: str = "dtype") -> str:
    """The canonical name of `x`, one of `names`; DtypeError naming `what` and the allowed values
    otherwise."""
    name = canonical(x)
    if name not in names:
        raise DtypeError(f"{what} {x!r} is unknown; allowed: {allowed(names)}")
    return name


def jnp_dtype(x, names=NAMES, what: str = "dtype"):
    """The jax.numpy dtype of `x` (see `dtype_name`)."""
    import jax.numpy as jnp
    return jnp.dtype(dtype_name(x, names, what))
