"""`python -m train.data.pretokenize --ray [ADDRESS|local]`: the plan's units packed as Ray tasks.

Each unit is one task (`train.data.pretokenize.pack_unit`, one CPU): it reads its pieces from the input
filesystem, tokenizes and packs them, and writes its shards and marker into the output folder,
which every node must reach (gs://, s3://, or a shared file system; a local path on a one-node
cluster). The driver only lists the inputs, submits the tasks and writes meta.json, so it moves
no rows; a task whose process dies is retried (its shards are rewritten under the same names).
The rows do not depend on which task ran where or when: they are fixed by the plan.

`ADDRESS` is a running cluster (`HOST:PORT` of its head, `auto`, `ray://HOST:PORT`); `local`
starts a cluster in this process with --workers CPUs (all of this host's without it), or joins
the one this Python process already started.
"""

from __future__ import annotations

from train.data import pipeline as data_lib


def connect(address: str, workers: int) -> None:
    """Join (or start, for `local`) the cluster; failures are one DataError."""
    import ray
    if ray.is_initialized():
        return
    try:
        if address == "local":
            ray.init(address="local", num_cpus=workers if workers > 1 else None,
                     include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise data_lib.DataError(f"--ray {address}: cannot connect "
                                 f"({str(e).splitlines()[0]})") from None


def run(jobs: list, address: str, workers: int) -> dict:
    """{unit: record} of `jobs` [(job, unit, pieces)], one Ray task each; the first data error
    of a task stops the run and is raised here as a DataError (the other tasks are cancelled)."""
    import ray

    from train.data.pretokenize import pack_unit
    connect(address, workers)
    task = ray.remote(num_cpus=1, max_retries=2)(pack_unit)
    limit = workers if workers > 1 else int(ray.cluster_resources().get("CPU", 1))
    pending, queue, done = [], list(jobs), {}
    while queue or pending:
        while queue and len(pending) < 2 * limit:
            pending.append(task.remote(*queue.pop(0)))
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            record = ray.get(ready[0])
        except Exception as e:  # RayTaskError wraps the task's exception as e.cause
            for ref in pending:
                ray.cancel(ref, force=True)
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ValueError):        # DataError, InputError: bad input
                raise data_lib.DataError(str(cause)) from None
            raise
        done[record["unit"]] = record
    return done
