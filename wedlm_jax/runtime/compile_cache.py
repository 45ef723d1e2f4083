"""JAX's persistent compilation cache for the command-line programs (wedlm-decode, the batch job,
wedlm-serve, wedlm-train): a second start with the same shapes loads the compiled programs
instead of compiling them again.

    add_arguments(parser)          --compile-cache DIR, --no-compile-cache
    enable(args.compile_cache)     before the first compile; returns the folder (None: off)

The folder defaults to $WEDLM_COMPILE_CACHE (`off` turns it off), else ~/.cache/wedlm-jax/xla. Entries are keyed by
the program, the compiler version and the devices, so a cache is safe to share between runs and
models; delete the folder to reclaim the space.
"""

from __future__ import annotations

import os

ENV = "WEDLM_COMPILE_CACHE"
MIN_COMPILE_SECONDS = 0.5   # smaller programs compile faster than they load


def default_dir() -> str:
    return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "wedlm-jax", "xla")


def add_arguments(parser) -> None:
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--compile-cache", default=None, metavar="DIR",
                   help=f"persistent compilation cache folder (default ${ENV}, else "
                        "~/.cache/wedlm-jax/xla)")
    g.add_argument("--no-compile-cache", dest="compile_cache", action="store_const", const="off",
                   help="compile every program afresh")


def enable(directory: str | None = None) -> str | None:
    """Turn the cache on at `directory` (None: `default_dir()`; "off": leave it off)."""
    directory = directory or default_dir()
    if directory == "off":
        return None
    import jax
    path = os.path.abspath(directory)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compile-cache {path}: cannot create it ({e.strerror}); pass another "
                         "folder or --no-compile-cache") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path
