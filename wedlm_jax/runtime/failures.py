"""Failures that end a run, told in one line (README, "When something fails").

    full = disk_full(exc)     # the ENOSPC / EDQUOT OSError anywhere in exc's chain, or None
    check_space(path, need, what)  # DiskFullError before writing `need` bytes where there is less room
    format_bytes(n[, unit])   # '1.25 GiB', '384.00 KiB': the one byte formatter of the messages
    reason = out_of_memory(exc)  # the compiler's / runtime's one-line reason when it ran out of
                                 # device memory, or None
    signal.signal(signal.SIGTERM, raise_interrupted)  # SIGINT / SIGTERM as `Interrupted`

Writers wrap the errors of the thread that hit the disk (Orbax re-raises its writer's error from
`wait_until_finished`, sometimes as another type), so the cause is looked for along the whole
`__cause__` / `__context__` chain and in exception groups, and by the C library's message when a
wrapper dropped the errno.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded")
GIB = 1 << 30
UNITS = {"GiB": GIB, "MiB": 1 << 20, "KiB": 1 << 10}


def format_bytes(n: float, unit: str | None = None) -> str:
    """`n` bytes as text with two decimals: in `unit` (GiB, MiB or KiB) when given, else in the
    largest unit it reaches (0.38 MiB is '384.00 KiB', not '0.00 GiB'; under 1 KiB, '12 bytes')."""
    if unit is not None:
        if unit not in UNITS:
            raise ValueError(f"unit {unit!r} is unknown; allowed: {', '.join(UNITS)}")
        return f"{n / UNITS[unit]:.2f} {unit}"
    for name, size in UNITS.items():
        if abs(n) >= size:
            return f"{n / size:.2f} {name}"
    return f"{int(n)} bytes"


class DiskFullError(OSError):
    """Not enough room to write what comes next (checked before writing it)."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def disk_full(exc: BaseException | None) -> BaseException | None:
    """The exception in `exc`'s chain that says the disk (or quota) is full, or None."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e
        if any(t in str(e).lower() for t in _DISK_FULL_TEXT):
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def mount_point(path: str) -> str:
    """The mount point of the file system holding `path` (its nearest existing parent)."""
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    dev = os.stat(path).st_dev
    while path != os.path.dirname(path) and os.stat(os.path.dirname(path)).st_dev == dev:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    """Free bytes on the file system holding `path` (its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free


def check_writable(path: str, what: str) -> None:
    """PermissionError naming `what` and `path` when nothing can be written there (a read-only
    folder or file system): a file is created and removed in `path`, or in its nearest existing
    parent when it does not exist yet."""
    import tempfile
    where = os.path.abspath(path)
    while not os.path.isdir(where):
        parent = os.path.dirname(where)
        if parent == where:
            break
        where = parent
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".wedlm-write-check-"):
            pass
    except OSError as e:
        raise PermissionError(f"{what} {path}: cannot write in {where} ({e.strerror})") from None


def check_space(path: str, need: int, what: str) -> None:
    """DiskFullError naming `what`, `path` and both sizes when `path`'s file system has fewer than
    `need` bytes free."""
    free = free_bytes(path)
    if free < need:
        raise DiskFullError(f"{what} needs about {format_bytes(need)} under {path}, only "
                            f"{format_bytes(free)} free on {mount_point(path)}")


OOM_MARKERS = ("exceeds available hbm", "resource_exhausted", "out of memory",
               "exceeds the memory", "ran out of memory")


def out_of_memory(error: BaseException) -> str | None:
    """The compiler's or runtime's one-line reason when `error` says the device ran out of memory
    (libtpu: "HLO temporaries (27.67G) exceeds available HBM (15.75G)"; XLA: RESOURCE_EXHAUSTED),
    else None."""
    text = str(error)
    if not any(m in text.lower() for m in OOM_MARKERS):
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hit = next((ln for ln in lines if any(m in ln.lower() for m in OOM_MARKERS)), lines[0])
    return hit[:400]


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived during a write that must clean up (raised from the handler
    `raise_interrupted`; a BaseException, so no `except Exception` swallows it)."""


def raise_interrupted(signum, frame):
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)
