"""Training checkpoints: an Orbax CheckpointManager (async, every N steps, keep K).

Each checkpoint `<dir>/<step>/` holds the items
    state   params (f32 master weights), optimizer state and step (StandardSave; sharded arrays)
    data    the Grain iterator state (JSON), for exact resume of the data order
    config  the training config (JSON), for the record
Orbax finalizes a step by writing `commit_success.txt` and `_CHECKPOINT_METADATA` (with a commit
timestamp) after every item is written; a step folder without them is half-written (killed
mid-save) and is never resumed from. `restore_latest` walks the complete steps newest first and
falls back to an older one when a newer one cannot be read. Restoring takes the abstract state with
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


def restore_latest(mgr: ocp.CheckpointManager, abstract_state, set_aside: bool = True):
    """(step, state, data_state) from the newest complete, readable checkpoint, or None when there
    is none. `abstract_state`: ShapeDtypeStructs carrying the target shardings. Step folders newer
    than the one restored (half-written or unreadable) are renamed `<step>.incomplete[-k]` (when
    `set_aside`; do it on one process only) so the run can save those steps again; nothing is
    deleted."""
    directory = epath.Path(mgr.directory)
    rejected = []
    for step in sorted(_step_dirs(directory), reverse=True):
        path = directory / str(step)
        if not is_complete(path):
            log.warning("checkpoint %s is incomplete (no Orbax commit markers); skipping it", path)
            rejected.append(path)
            continue
        try:
            out = mgr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore()))
        except Exception as e:  # a damaged step: fall back to the previous one
            log.warning("checkpoint %s cannot be read (%s: %s); trying the previous one", path,
                        type(e).__name__, (str(e).splitlines() or [""])[0][:200])
            rejected.append(path)
            continue
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
