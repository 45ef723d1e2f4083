"""Several processes, one job (jax.distributed), set up the same way by every program that runs on
several hosts: `wedlm-train` (one mesh over every process's devices) and `wedlm-decode --input`
(each process decodes its share of the lines on its own devices).

The flags, or the environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID; with neither, a program that asks for it (`auto`) lets jax detect the cluster
(TPU pod slice, Slurm, ...)."""

from __future__ import annotations

import os


def add_arguments(parser) -> None:
    g = parser.add_argument_group("multi-host (jax.distributed; or the environment variables "
                                  "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    g.add_argument("--coordinator-address", help="host:port of process 0")
    g.add_argument("--num-processes", type=int, help="how many processes run the job")
    g.add_argument("--process-id", type=int, help="this process's index in [0, --num-processes)")


def _env_int(name: str):
    v = os.environ.get(name)
    try:
        return int(v) if v else None
    except ValueError:
        raise SystemExit(f"{name}={v!r} is not an integer") from None


def settings(args, prog: str):
    """(coordinator address, processes, process id) from the flags or the environment, or None
    (one process); SystemExit with one line when they are incomplete or out of range."""
    addr = getattr(args, "coordinator_address", None) or os.environ.get("JAX_COORDINATOR_ADDRESS")
    nproc = getattr(args, "num_processes", None) or _env_int("JAX_NUM_PROCESSES")
    pid = getattr(args, "process_id", None)
    pid = _env_int("JAX_PROCESS_ID") if pid is None else pid
    if not (addr or nproc):
        return None
    if not (addr and nproc and pid is not None):
        raise SystemExit(f"{prog}: multi-host needs the coordinator address, the number of "
                         "processes and this process's id (flags or JAX_* environment)")
    if nproc < 1 or not 0 <= pid < nproc:
        raise SystemExit(f"{prog}: --process-id {pid} must be in [0, --num-processes {nproc})")
    return addr, nproc, pid


def initialize(args, prog: str, auto: bool = False) -> tuple[int, int]:
    """Join the job (before anything else touches jax's devices); returns (this process's index,
    the process count): (0, 1) when it runs alone."""
    import jax
    s = settings(args, prog)
    if s is not None:
        jax.distributed.initialize(coordinator_address=s[0], num_processes=s[1], process_id=s[2])
    elif auto:
        jax.distributed.initialize()
    return jax.process_index(), jax.process_count()
