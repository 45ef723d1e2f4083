"""Training checkpoints: an Orbax CheckpointManager (async, every N steps, keep K).

Each checkpoint `<dir>/<step>/` holds the items
    state   params (f32 master weights), optimizer state and step (StandardSave; sharded arrays)
    data    the Grain iterator state (JSON), for exact resume of the data order
    config  the training config (JSON), for the record
Orbax finalizes a step by writing `commit_success.txt` and `_CHECKPOINT_METADATA` (with a commit
timestamp) after every item is written; a step folder without them is half-written (killed
mid-save) and is never resumed from: `restore_latest` sets such folders aside (renamed
`<step>.incomplete`). A complete step that cannot be restored is an error, never skipped or renamed.
Before anything is restored, `check_resume` compares the newest checkpoint's saved config with the
requested one (`meaning_diff`), and `lock_run_dir` makes sure one run at a time writes a folder.
Restoring takes the abstract state with
the CURRENT mesh's shardings, so a run may resume on a different mesh (or device count). Paths go
through etils.epath, so `checkpoint.dir` may be a local folder or a bucket (gs://...).
"""

from __future__ import annotations

import json
import logging

import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger("wedlm-train")

ITEMS = ("state", "data", "config")


def make_manager(directory: str, *, every: int, keep: int, async_save: bool = True,
                 ) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=every, max_to_keep=keep, enable_async_checkpointing=async_save,
        create=True)
    path = epath.Path(directory)
    if "://" not in str(directory):
        path = path.absolute()
    return ocp.CheckpointManager(path, item_names=ITEMS, options=options)


def save(mgr: ocp.CheckpointManager, step: int, state, data_state: dict, config: dict,
         force: bool = False) -> bool:
    """Save (asynchronously when the manager is async) if `step` is due, or `force`."""
    return mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config)), force=force)


def state_bytes(state) -> int:
    """Bytes this process writes for a checkpoint of `state`, about: its share of every array."""
    import jax
    total = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
    return total // max(jax.process_count(), 1)


def is_complete(step_dir) -> bool:
    """Orbax's finalization markers are present (the step was fully written and committed)."""
    step_dir = epath.Path(step_dir)
    if not (step_dir / "commit_success.txt").exists():
        return False
    try:
        return bool(json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
                    .get("commit_timestamp_nsecs"))
    except (OSError, ValueError):
        return False


def _step_dirs(directory) -> list[int]:
    directory = epath.Path(directory)
    if not directory.is_dir():
        return []
    return [int(c.name) for c in directory.iterdir() if c.name.isdigit()]


def complete_steps(directory) -> list[int]:
    """Steps with a complete checkpoint under `directory`, newest first."""
    return sorted((s for s in _step_dirs(directory) if is_complete(epath.Path(directory) / str(s))),
                  reverse=True)


class ResumeError(RuntimeError):
    """A checkpoint folder this run must not resume from or write into as asked."""


def restore_latest(mgr: ocp.CheckpointManager, abstract_state, set_aside: bool = True):
    """(step, state, data_state) from the newest complete checkpoint, or None when there is none.
    `abstract_state`: ShapeDtypeStructs carrying the target shardings. Half-written step folders
    newer than it (no commit markers) are renamed `<step>.incomplete[-k]` (when `set_aside`; do it
    on one process only) so the run can save those steps again. A complete step that cannot be
    restored raises ResumeError and nothing is renamed: it is the user's to inspect or move."""
    directory = epath.Path(mgr.directory)
    rejected = []
    for step in sorted(_step_dirs(directory), reverse=True):
        path = directory / str(step)
        if not is_complete(path):
            log.warning("checkpoint %s is incomplete (no Orbax commit markers); setting it aside",
                        path)
            rejected.append(path)
            continue
        try:
            out = mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore()))
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise ResumeError(
                f"checkpoint {path} is complete but cannot be restored ({type(e).__name__}: "
                f"{first}); nothing was changed. Move that folder out of {directory} to resume "
                f"from the previous step, or use a new checkpoint.dir") from None
        _set_aside(mgr, rejected, set_aside)
        return step, out["state"], out["data"]
    _set_aside(mgr, rejected, set_aside)
    return None


def _set_aside(mgr, paths, enabled: bool):
    if not paths:
        return
    if enabled:
        for path in paths:
            dst, k = epath.Path(f"{path}.incomplete"), 1
            while dst.exists():
                dst, k = epath.Path(f"{path}.incomplete-{k}"), k + 1
            path.rename(dst)
            log.warning("moved the unusable checkpoint %s to %s", path, dst)
    mgr.reload()


def read_config(directory, step: int) -> dict:
    """The training config saved with checkpoint `step`."""
    return json.loads((epath.Path(directory) / str(step) / "config" / "metadata").read_text())


# ------------------------------------------------------------------ before a run touches a folder

# Keys that do not change what a run computes: output plumbing, logging, the device layout (a run
# may resume on another mesh), the attention kernel choice and how the loss is chunked. Every
# other key must match the checkpoint's saved config to resume; `steps` may grow (it extends the run).
NON_MEANING = ("checkpoint.", "mesh.", "log_every", "metrics_file", "peak_flops", "log_mfu", "progress",
               "distributed", "attention", "attention_tile", "remat", "loss_chunk",
               "data.skip_bad_lines",
               "lora.base_hash",    # compared by train.lora.check_base, after the base is read
               "lora.base_quantize_group",   # as the quantized base's hash (unset = the default)
               "steps")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def meaning_diff(saved: dict, requested: dict, defaults: dict | None = None
                 ) -> list[tuple[str, object, object]]:
    """[(dotted key, saved value, requested value)] for every key that changes the run's meaning
    (model shape, objective, batch, data, schedule) and differs. A key the saved config lacks (a
    checkpoint older than that key) counts as equal when the requested value is its default in
    `defaults`; a key the requested config lacks (no longer a setting) is not compared."""
    a, b = _flatten(saved), _flatten(requested)
    d = _flatten(defaults or {})
    diffs = []
    for key in sorted(set(a) | set(b)):
        if any(key == n or (n.endswith(".") and key.startswith(n)) for n in NON_MEANING):
            continue
        if key not in b or (key not in a and key in d and d[key] == b[key]):
            continue
        va, vb = a.get(key), b.get(key)
        if isinstance(va, list):
            va = tuple(va)
        if isinstance(vb, list):
            vb = tuple(vb)
        if va != vb:
            diffs.append((key, a.get(key), b.get(key)))
    return diffs


def check_resume(directory: str, requested: dict) -> int | None:
    """The step a run with config `requested` resumes from in `directory` (None: nothing to resume).
    Reads only the newest complete checkpoint's saved config; raises ResumeError, before anything
    is restored or renamed, when it differs in meaning or is past `requested['steps']`."""
    steps = complete_steps(directory)
    if not steps:
        return None
    latest = steps[0]
    try:
        saved = read_config(directory, latest)
    except (OSError, ValueError) as e:
        raise ResumeError(f"checkpoint {directory}/{latest} is complete but its saved config "
                          f"cannot be read ({e}); nothing was changed. Move that folder away or "
                          f"use a new checkpoint.dir") from None
    from train.config import TrainConfig
    diffs = meaning_diff(saved, requested, TrainConfig().to_dict())
    if diffs:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diffs[:12])
        more = f" ... and {len(diffs) - 12} more" if len(diffs) > 12 else ""
        raise ResumeError(
            f"checkpoint.dir {directory} holds step {latest} of a run with a different config "
            f"({listed}{more}); nothing was changed. Ways forward: a new checkpoint.dir; or "
            f"checkpoint.resume=false to start fresh there (its checkpoints are moved into a "
            f"previous-* subfolder); or, to train that run further, change only steps "
            f"(it was {saved.get('steps')})")
    if latest > int(requested["steps"]):
        raise ResumeError(f"checkpoint.dir {directory} already holds step {latest}, past "
                          f"steps={requested['steps']}; raise steps to train further, or use a "
                          f"new checkpoint.dir")
    return latest


def move_previous(directory: str) -> str | None:
    """For `checkpoint.resume=false`: move every step folder (and metrics.jsonl, tb/) of
    `directory` into a new `previous-<UTC time>` subfolder; nothing is deleted. Returns it."""
    import os
    import time
    if not os.path.isdir(directory):
        return None
    names = [n for n in os.listdir(directory)
             if n.split(".", 1)[0].isdigit() or n in ("metrics.jsonl", "tb")]
    if not names:
        return None
    base = os.path.join(directory, time.strftime("previous-%Y%m%dT%H%M%SZ", time.gmtime()))
    dst, k = base, 1
    while os.path.exists(dst):
        dst, k = f"{base}-{k}", k + 1
    os.makedirs(dst)
    for n in sorted(names):
        os.rename(os.path.join(directory, n), os.path.join(dst, n))
    log.warning("checkpoint.resume=false: moved %s of %s into %s", ", ".join(sorted(names)),
                directory, dst)
    return dst


def truncate_metrics(path: str, step: int) -> int:
    """Drop the rows of a metrics JSONL file past `step` (they are about to be logged again after
    resuming from `step`); rewritten atomically. Returns the number of rows dropped."""
    import os
    import tempfile
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            row_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            continue  # a torn last line of a killed run
        if isinstance(row_step, int) and row_step <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) == len(lines):
        return 0
    fd, tmp = tempfile.mkstemp(prefix=".metrics-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return len(lines) - len(keep)


LOCK_NAME = ".wedlm-train.lock"


def lock_run_dir(directory: str):
    """Hold an exclusive OS lock (fcntl.flock) on `directory/.wedlm-train.lock` for as long as the
    returned file object stays open; the kernel releases it when the process ends, however it
    ends. Raises ResumeError naming the holder's pid when another process holds it."""
    import fcntl
    import os
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ResumeError(f"checkpoint.dir {directory} is in use by another wedlm-train run "
                          f"(pid {holder}, holding {path}); wait for it to finish, or use another "
                          f"checkpoint.dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f
