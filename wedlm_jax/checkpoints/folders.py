"""Checkpoint folders written whole or not at all.

Every writer builds its output in a hidden sibling folder (`.NAME.partial-HOST-PID-*`), writes
`config.json` last, and renames the folder into place only when it is complete; an existing
checkpoint at the destination is replaced only with `force=True`, and only after the new one is
complete. A writer killed outright leaves its partial folder behind; the next writer into the same
parent folder removes the partial folders of processes of this host that are no longer alive
(never a live one's)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
from typing import Iterator

from wedlm_jax import safetensors_io as st
from wedlm_jax.safetensors_io import CheckpointError

PARAMS_DIR = "params"   # an Orbax checkpoint's parameters: DIR/params/


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def looks_like_checkpoint(folder: str) -> bool:
    names = set(os.listdir(folder))
    return bool({"config.json", PARAMS_DIR, st.INDEX_NAME} & names) or \
        any(n.endswith(".safetensors") for n in names)


def check_out_dir(out_dir: str, force: bool, is_complete=looks_like_checkpoint,
                  what: str = "a checkpoint", force_hint: str = "--force (force=True)") -> None:
    """Refuse, before any work, an output folder we must not replace: a file or symlink, a
    non-empty folder that `is_complete` does not recognise (even with force), or one holding
    `what` without force."""
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is a file or a symlink, not a folder; "
                              f"refusing to replace it")
    if not os.listdir(out_dir):
        return
    if not is_complete(out_dir):
        raise CheckpointError(f"{out_dir}: exists, is not empty and holds no {what.split(' ', 1)[-1]}; "
                              f"refusing to replace it (even with --force); choose another output folder")
    if not force:
        raise CheckpointError(f"{out_dir}: already holds {what}; pass {force_hint} to replace it")


@contextlib.contextmanager
def atomic_output_dir(out_dir, force: bool = False, is_complete=looks_like_checkpoint,
                      what: str = "a checkpoint") -> Iterator[str]:
    """Yield a hidden temporary sibling of `out_dir` to write into; on success rename it into
    place (replacing an existing one only if `force`), on any error delete it. Every writer of a
    folder (checkpoints, packed training data) goes through here."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    check_out_dir(out_dir, force, is_complete, what)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    remove_dead_partials(parent)
    tmp = tempfile.mkdtemp(prefix=f".{name}.partial-{_owner_tag()}-", dir=parent)
    try:
        yield tmp
        check_out_dir(out_dir, force, is_complete, what)
        if os.path.lexists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{name}.old-{_owner_tag()}-", dir=parent)
            os.rename(out_dir, os.path.join(old, name))
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- leftovers


# `.NAME.partial-HOST-PID-xxxx` (being written) and `.NAME.old-HOST-PID-xxxx` (a replaced output,
# deleted once the new one is in place); HOST is sanitised to [A-Za-z0-9_] so the name parses.
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<host>\w+)-(?P<pid>\d+)-[^/]+$")


def host_tag() -> str:
    return re.sub(r"\W", "_", socket.gethostname()) or "host"


def _owner_tag(pid: int | None = None) -> str:
    return f"{host_tag()}-{os.getpid() if pid is None else pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_partials(parent: str, pid: int | None = None) -> list[str]:
    """Remove what killed writers left in `parent`: partial folders of processes of this host
    that are gone (or, with `pid`, that process's own), and `.old-` folders of replaced outputs,
    which go back into place when the new output never arrived. Returns the names handled."""
    done = []
    try:
        names = os.listdir(parent)
    except OSError:
        return done
    for n in sorted(names):
        m = _LEFTOVER.match(n)
        if not m or m["host"] != host_tag():
            continue
        owner = int(m["pid"])
        if pid is not None and owner != pid:
            continue
        if pid is None and (owner == os.getpid() or _pid_alive(owner)):
            continue
        path = os.path.join(parent, n)
        target = os.path.join(parent, m["name"])
        inner = os.path.join(path, m["name"])
        if m["kind"] == "old" and os.path.isdir(inner) and not os.path.lexists(target):
            os.rename(inner, target)  # killed between the two renames: put the old one back
        shutil.rmtree(path, ignore_errors=True)
        done.append(n)
    return done
