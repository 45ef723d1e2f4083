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
from wedlm_jax.config import ConfigError, ModelConfig
from wedlm_jax.safetensors_io import CheckpointError

PARAMS_DIR = "params"   # an Orbax checkpoint's parameters: DIR/params/


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def source_config(source: str | None) -> dict:
    """The fields of `source`'s config.json ({} without a source or a config.json)."""
    path = os.path.join(source, "config.json") if source else None
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def carried_config(hf: dict, source: str | None) -> dict:
    """The config.json a conversion writes: `source`'s (a folder's config.json, when there is one)
    with every field kept, in its order, except those whose value the conversion's `hf` changes.
    The fields of `hf` the source lacks come after, only where the model config read from the
    source's fields would differ (an older spelling, e.g. top-level rope_theta beside
    rope_parameters, is not added) and for the weights' `dtype` when the source names none."""
    raw = source_config(source)
    out = dict(raw)
    out.update({k: v for k, v in hf.items() if k in raw and raw[k] != v})
    missing = {k: v for k, v in hf.items() if k not in raw}
    try:
        reads_same = bool(raw) and ModelConfig.from_hf_dict(out) == ModelConfig.from_hf_dict(hf)
    except ConfigError:
        reads_same = False
    if reads_same:
        missing = {k: v for k, v in missing.items()
                   if k == "dtype" and "torch_dtype" not in raw}
    out.update(missing)
    return out


def write_config(folder: str, hf: dict, source: str | None) -> None:
    """`carried_config` into `folder`/config.json: the source's file byte for byte when the
    conversion changes none of its fields."""
    out = carried_config(hf, source)
    if out and out == source_config(source):    # then `out` holds the source's keys in its order
        shutil.copyfile(os.path.join(source, "config.json"), os.path.join(folder, "config.json"))
        return
    write_json(os.path.join(folder, "config.json"), out)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
        os.chmod(tmp, 0o777 & ~current_umask())   # mkdtemp's 0700 would outlive the rename
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
