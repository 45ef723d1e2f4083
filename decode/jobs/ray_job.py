"""The batch job on a Ray cluster: replicas of the model, each a Ray Data actor, take blocks of
prompts as they free up.

    wedlm-decode --checkpoint DIR --input IN --output OUT --ray [ADDRESS|local] --replicas N
        [--block-size 64] [--replica-cpus C] [--replica-gpus G] [--replica-tpus T]

IN: a JSONL or Parquet file, or a folder of them (`*.parquet` are read as Parquet, any other file
as JSONL), on a local disk or any filesystem pyarrow opens (gs://, s3://, hdfs://). The lines are
the batch job's (`decode.jobs.batch_job`: prompt or messages, optional id and settings); a
Parquet row is a line with the same columns (null: absent), named FILE:ROW (1-based). Ray Data
reads the files; the driver checks every line before any replica starts, a bad one named FILE:LINE.

OUT: a folder (local or any pyarrow filesystem) of part files, one per block: part-P.jsonl, or
part-P.parquet when OUT ends in `.parquet` (P: the block's first prompt's position in the input).
Each holds the records the single-process job writes (id, text, token_ids, finish_reason, ...)
and appears whole or not at all (written beside it and renamed; an object store publishes an
object whole). A rerun of the same command skips the ids already in OUT, so a killed driver loses
only the blocks in flight. On a cluster of several nodes, IN and OUT must be where every node sees
them (a shared file system, or an object store): the read tasks and the replicas run anywhere.

With --enable-lora --lora-modules NAME=PATH ..., every replica loads the adapters at start and a
line's `model` picks one (or the base), as in the single-process job.

Replicas (`Replica`): Ray Data's actor pool (`map_batches`, an `ActorPoolStrategy` of N actors) hands each
free actor the next block; an actor opens the checkpoint once and decodes its blocks through one
Decoder and continuous batcher. An actor whose process dies is restarted and its block retried
(Ray Data's defaults: max_restarts=-1, max_task_retries=-1); the retry writes the same part file
again, so no id is lost or written twice. CPU replicas of one CPU each divide the host's cores (XLA's
matmuls on one thread each).

From Python: `run_ray_job(decode.cli.parse_args([...the same flags...]))` returns the job's counts
(with Ray already initialised in the process, that cluster is used).

`ADDRESS`: a running cluster (`HOST:PORT` of its head, `auto`, or `ray://HOST:PORT`); `local` (or
no value) starts a cluster on this machine for the job.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
import time

from decode.config import DecodeConfigError, DoorOptions


# the flags that mean something only with --ray: their defaults (a flag set otherwise without
# --ray is refused)
RAY_DEFAULTS = dict(replicas=1, block_size=64, replica_cpus=1.0, replica_gpus=0.0,
                    replica_tpus=0.0, lazy_compile=False)


def add_arguments(parser) -> None:
    g = parser.add_argument_group("Ray (--input on a Ray cluster: decode.jobs.ray_job; the flags "
                                  "below go with --ray)")
    g.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS|local",
                   help="run --input on Ray: a cluster's address, or `local` to start one here")
    d = RAY_DEFAULTS
    g.add_argument("--replicas", type=int, default=d["replicas"], help="model replicas (Ray actors)")
    g.add_argument("--block-size", type=int, default=d["block_size"], help="prompts per block "
                   "(the unit handed to a replica, retried and written)")
    g.add_argument("--replica-cpus", type=float, default=d["replica_cpus"],
                   help="CPUs each replica takes")
    g.add_argument("--replica-gpus", type=float, default=d["replica_gpus"],
                   help="GPUs each replica takes")
    g.add_argument("--replica-tpus", type=float, default=d["replica_tpus"],
                   help="TPU chips each replica takes")
    g.add_argument("--lazy-compile", action="store_true", help="replicas compile prompt buckets on "
                   "first use instead of at start (a faster start; the first blocks carry the compiles)")


def check_ray_flags(args) -> None:
    """Without --ray, a Ray flag set to anything but its default is refused (it would be ignored):
    one DecodeConfigError naming both flags."""
    if args.ray is not None:
        return
    for name, default in RAY_DEFAULTS.items():
        if getattr(args, name) != default:
            flag = "--" + name.replace("_", "-")
            raise DecodeConfigError(f"{flag} goes with --ray (the batch job's replicas on a Ray "
                                    f"cluster); without --ray it would be ignored: add --ray "
                                    f"[ADDRESS|local] or drop {flag}")


@dataclasses.dataclass(frozen=True)
class Resources:
    cpus: float
    gpus: float
    tpus: float

    @classmethod
    def from_args(cls, args) -> "Resources":
        for flag, value in (("--replica-cpus", args.replica_cpus), ("--replica-gpus", args.replica_gpus),
                            ("--replica-tpus", args.replica_tpus)):
            if value < 0:
                raise DecodeConfigError(f"{flag} {value}: must be >= 0")
        return cls(args.replica_cpus, args.replica_gpus, args.replica_tpus)

    def remote_args(self) -> dict:
        return dict(num_cpus=self.cpus, num_gpus=self.gpus,
                    resources={"TPU": self.tpus} if self.tpus else None)

    def env(self) -> dict:
        """A CPU replica's environment: on the CPU only, and with one CPU each, XLA's matmuls on
        one thread (--xla_cpu_multi_thread_eigen=false), so N replicas of a host share its cores
        instead of each spreading over all of them (XLA has no flag for N > 1 threads: a replica
        of several CPUs runs XLA's own thread pool over the host)."""
        if self.gpus or self.tpus:
            return {}
        env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        if self.cpus <= 1:
            env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip()
        return env


# ----------------------------------------------------------------------------------- checks

def check_arguments(args) -> None:
    from wedlm_jax.runtime import distributed
    if args.input is None:
        raise DecodeConfigError("--ray runs the batch job: give --input and --output")
    if args.output is None:
        raise DecodeConfigError("--input needs --output (with --ray: a folder of part files)")
    if args.replicas < 1:
        raise DecodeConfigError(f"--replicas {args.replicas}: must be >= 1")
    if args.block_size < 1:
        raise DecodeConfigError(f"--block-size {args.block_size}: must be >= 1")
    if distributed.settings(args, "wedlm-decode") is not None:
        raise DecodeConfigError("--ray runs replicas on a Ray cluster; the jax.distributed flags "
                                "(--coordinator-address ...) are for one model over several hosts")
    for flag, on in (("--json", args.json), ("--stream", args.stream), ("--trace", args.trace)):
        if on:
            raise DecodeConfigError(f"{flag} does not apply to --input (results go to --output)")
    if "://" not in args.input and not os.path.exists(args.input):
        raise DecodeConfigError(f"--input {args.input}: no such file or folder")


def connect(address: str) -> None:
    """Join (or start, for `local`) the cluster; an unreachable address is one DecodeConfigError."""
    import ray
    host, _, port = address.rpartition(":")
    if address not in ("auto", "local") and not address.startswith("ray://") and port.isdigit():
        import socket
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise DecodeConfigError(f"--ray {address}: cannot reach the cluster's head "
                                    f"({e.strerror or e})") from None
    if ray.is_initialized():       # called from Python with Ray already up: that cluster
        current = ray.get_runtime_context().gcs_address
        if address not in ("auto", "local", current):
            raise DecodeConfigError(f"--ray {address}: this process is already connected to the "
                                    f"cluster at {current}")
        return
    if address == "local":
        ray.init(address="local", include_dashboard=False, log_to_driver=True)
        return
    try:
        ray.init(address=address, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise DecodeConfigError(f"--ray {address}: cannot connect ({str(e).splitlines()[0]})") from None


def check_resources(replicas: int, need: Resources) -> None:
    """The cluster must hold `replicas` replicas at once (else the pool would wait forever)."""
    import ray
    total = ray.cluster_resources()
    for name, each in (("CPU", need.cpus), ("GPU", need.gpus), ("TPU", need.tpus)):
        if each and replicas * each > total.get(name, 0):
            fit = int(total.get(name, 0) // each)
            raise DecodeConfigError(f"--replicas {replicas} need {replicas * each:g} {name} "
                                    f"({each:g} each); the cluster has {total.get(name, 0):g} "
                                    f"(room for {fit} replica(s))")


def probe_checkpoint(args, need: Resources) -> None:
    """Open the checkpoint (config, tokenizer; no weights) where a replica runs."""
    import ray

    def probe():
        from decode.checkpoint import OpenCheckpoint
        try:
            OpenCheckpoint.from_args(args)
        except (DecodeConfigError, OSError, ValueError) as e:
            return str(e).splitlines()[0] if str(e) else type(e).__name__
        return None

    remote = ray.remote(max_retries=0, runtime_env={"env_vars": need.env()}, **need.remote_args())
    error = ray.get(remote(probe).remote())
    if error is not None:
        raise DecodeConfigError(f"--checkpoint {args.checkpoint}: a replica cannot open it: {error}")


# ----------------------------------------------------------------------------------- input

def read_records(path: str):
    """(file, line, object) of every input line, the files read by Ray Data (sorted by name)."""
    import ray
    from decode.text import json_line_objects
    try:
        ds = ray.data.read_binary_files(path, include_paths=True)
        files = sorted((row["path"], row["bytes"]) for row in ds.iter_rows())
    except Exception as e:  # noqa: BLE001 - pyarrow and Ray raise many kinds; one line for all
        raise DecodeConfigError(f"--input {path}: cannot read it ({str(e).splitlines()[0]})") from None
    for name, data in files:
        if name.endswith(".parquet"):
            yield from _parquet_rows(name, data)
        else:
            for lineno, obj in json_line_objects(io.BytesIO(data), name, keep_bad=True):
                yield name, lineno, obj


def _parquet_rows(name: str, data: bytes):
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as e:
        raise DecodeConfigError(f"{name}: not a Parquet file ({e})") from None
    for row, obj in enumerate(table.to_pylist(), 1):
        yield name, row, {k: v for k, v in obj.items() if v is not None}


def make_blocks(items: list, done: set, block_size: int) -> list[dict]:
    """The rows Ray Data hands out: {block: part name, items: pickled [(file, Item)]} of the items
    whose ids are not in `done`, in input order, named by their first item's position."""
    from decode.jobs.lines import id_key
    from decode.jobs.part_folder import PART
    todo = [(pos, f, it) for pos, (f, it) in enumerate(items) if id_key(it.id) not in done]
    return [dict(block=f"{PART}{chunk[0][0]:09d}",
                 items=pickle.dumps([(f, it) for _, f, it in chunk]))
            for chunk in (todo[i:i + block_size] for i in range(0, len(todo), block_size))]


# ----------------------------------------------------------------------------------- the job

def run_ray_job(args) -> dict:
    """The `--input ... --ray` path of wedlm-decode: returns the job's counts (requests, tokens,
    errors, blocks, wall_s, tokens_per_s, driver_s_per_block, skipped)."""
    from decode.checkpoint import OpenCheckpoint
    from decode.jobs.lines import check_records, id_key
    from decode.jobs.part_folder import PartFolder
    from decode.text import split_stop_strings

    check_arguments(args)
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        raise DecodeConfigError("--ray needs Ray Data: pip install -e '.[ray]'") from None
    opts = DoorOptions.from_args(args)           # every option checked before anything starts
    need = Resources.from_args(args)
    out = PartFolder.open(args.output)            # writable, else refused here
    ckpt = OpenCheckpoint.from_args(args, opts.placement)
    tokenizer = ckpt.tokenizer
    cli_stop_ids, _ = split_stop_strings(tokenizer, args.stop)
    base_ids = list(dict.fromkeys(list(ckpt.default_stop_ids) + list(args.stop_id) + cli_stop_ids))
    base_name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    opts.lora.check_folders(base_name)           # every adapter folder read before Ray starts
    connect(args.ray)
    check_resources(args.replicas, need)
    records = list(read_records(args.input))
    items = check_records(records, tokenizer, opts.sampling, base_ids, list(args.stop), args.chat,
                          args.capacity, ckpt.config.vocab_size,
                          opts.engine.constraint_backend, args.tool_call_parser,
                          (tuple(name for name, _ in opts.lora.lora_modules), base_name))
    if not items:
        raise DecodeConfigError(f"--input {args.input}: no prompts (every line is blank)")
    out.check_ids([(f"{f}:{line}", it.id) for (f, line, _), it in zip(records, items)])
    done = out.done_ids()
    blocks = make_blocks([(f, it) for (f, _, _), it in zip(records, items)], done, args.block_size)
    skipped = sum(id_key(it.id) in done for it in items)
    if skipped:
        print(f"wedlm-decode: {skipped} of {len(items)} requests already in {args.output}; "
              f"decoding the other {len(items) - skipped} in {len(blocks)} block(s)", file=sys.stderr)
    if not blocks:
        print("wedlm-decode: nothing to do", file=sys.stderr)
        return dict(requests=0, tokens=0, errors=0, blocks=0, wall_s=0.0, tokens_per_s=0.0,
                    decode_tokens_per_s=0.0, driver_s_per_block=0.0, pids=set(), skipped=skipped)
    probe_checkpoint(args, need)
    capacity = args.capacity or max(len(it.prompt_ids) + it.sampling.max_new_tokens for it in items)
    print(RAY_NOTE, file=sys.stderr)
    stats = _decode_blocks(args, need, blocks, capacity, out.url)
    stats["skipped"] = skipped
    _summary(stats, args.output)
    return stats


# Ray's core worker logs one error-level line whenever an actor that may restart is created with
# its constructor's arguments in the object store, which Ray Data's actor pool always does: on a
# healthy run the job says so first, so the line reads as what it is
RAY_NOTE = ("[ray] starting the replicas; Ray may log 'constructor arguments in the object store "
            "and max_restarts > 0' at error level: expected (the driver holds those arguments "
            "for the whole job, so a restarted replica finds them)")


def _decode_blocks(args, need: Resources, blocks: list, capacity: int, url: str) -> dict:
    import ray
    from ray.data import ActorPoolStrategy, DataContext
    ctx = DataContext.get_current()
    ctx.max_consecutive_actor_init_deaths = 2 * args.replicas   # a replica that cannot start: an error
    ds = ray.data.from_items(blocks, override_num_blocks=len(blocks))
    ds = ds.map_batches(Replica, batch_size=1, fn_constructor_kwargs=dict(
                            args=args, capacity=capacity, url=url),
                        compute=ActorPoolStrategy(size=args.replicas, max_tasks_in_flight_per_actor=1),
                        runtime_env={"env_vars": need.env()}, **need.remote_args())
    stats = dict(requests=0, tokens=0, errors=0, blocks=0, busy_s=0.0, pids=set())
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        for row in ds.iter_rows():
            stats["blocks"] += 1
            stats["busy_s"] += float(row["seconds"])
            stats["pids"].add(int(row["pid"]))
            for k in ("requests", "tokens", "errors"):
                stats[k] += int(row[k])
    except Exception as e:  # noqa: BLE001 - a replica's failure, one line (Ray wraps the cause)
        cause = getattr(e, "cause", None) or e
        text = str(cause).strip().splitlines()
        raise DecodeConfigError(f"a replica failed: {type(cause).__name__}: "
                                f"{text[-1] if text else ''}; every part already in "
                                f"{args.output} is whole and kept: rerun to go on") from None
    wall = time.perf_counter() - t0
    # decode_tokens_per_s: the replicas' rate once started (tokens over their busy time, shared)
    stats.update(wall_s=wall, tokens_per_s=stats["tokens"] / max(wall, 1e-9),
                 decode_tokens_per_s=stats["tokens"] * args.replicas / max(stats["busy_s"], 1e-9),
                 driver_s_per_block=(time.process_time() - c0) / max(stats["blocks"], 1))
    return stats


class Replica:
    """A Ray Data actor: the checkpoint opened once, one Decoder and Batcher for every block."""

    def __init__(self, args, capacity: int, url: str):
        from wedlm_jax.runtime import compile_cache, platforms
        platforms.choose()
        compile_cache.enable(args.compile_cache)
        from decode.checkpoint import OpenCheckpoint
        from decode.engine.runtime.batcher import Batcher
        from decode.jobs.batch_job import build_decoder
        from decode.jobs.part_folder import PartFolder
        opts = DoorOptions.from_args(args)
        ckpt = OpenCheckpoint.from_args(args, opts.placement)
        self.tokenizer = ckpt.tokenizer
        self.decoder = build_decoder(ckpt, opts, capacity)
        if self.decoder.adapters is not None:           # --enable-lora: the job's adapters, by name
            opts.lora.load_into(self.decoder.adapters)
        self.batcher = Batcher(self.decoder, window_policy=opts.engine.window_policy)
        self.batcher.warm_up(capacity, every_bucket=not args.lazy_compile)   # not in the blocks' time
        self.out = PartFolder.at(url)

    def __call__(self, batch: dict) -> dict:
        from decode.jobs.batch_job import decode_all, engine_requests
        rows = {k: [] for k in ("block", "requests", "tokens", "errors", "seconds", "pid")}
        for name, blob in zip(batch["block"], batch["items"]):
            pairs = pickle.loads(blob)
            requests = [engine_requests(self.decoder, [it], f)[0] for f, it in pairs]
            records, t0 = [], time.perf_counter()
            stats = decode_all(self.batcher, [it for _, it in pairs], requests, self.tokenizer,
                               records.append, progress=False)
            self.out.write(str(name), records)
            for k, v in (("block", str(name)), ("requests", len(records)), ("tokens", stats["tokens"]),
                         ("errors", stats["errors"]), ("seconds", time.perf_counter() - t0),
                         ("pid", os.getpid())):
                rows[k].append(v)
        return rows


def _summary(stats: dict, output: str) -> None:
    print(f"[ray] {stats['requests']} requests ({stats['skipped']} skipped) in {stats['blocks']} "
          f"blocks, {stats['tokens']} tokens in {stats['wall_s']:.1f} s (replica start included): "
          f"{stats['tokens_per_s']:.1f} tokens/s ({stats['decode_tokens_per_s']:.1f} once the "
          f"replicas had started); driver {1e3 * stats['driver_s_per_block']:.1f} ms "
          f"CPU per block -> {output}", file=sys.stderr)
    if stats["errors"]:
        print(f"wedlm-decode: {stats['errors']} request(s) failed in the engine (finish_reason "
              f"'error' in {output}); the others were written", file=sys.stderr)
