"""The batch job on Ray (`wedlm-decode --ray`): 1 against 2 replicas of the demo model on this
machine, and how far the driver lets it scale.

    python -m benchmarks.doors.ray_scaling [--requests 64] [--max-tokens 32] [--block-size 8]
        [--slots 8] [--rounds 1] [--out benchmarks/results/ray_scaling.json]

The held-out demo prompts (demo/model/eval.jsonl, cycled to --requests), greedy, no stop strings,
each run with its budget --max-tokens; one local Ray cluster of this machine's cores, four jobs
into fresh output folders, --rounds times in turn (medians): 1 replica on 1 core, 1 replica on 2
cores (XLA's own threads), 2 replicas on 1 core each, and 2 on 1 core each with blocks of 1
prompt. Each job's figures: tokens/s over the whole job (the replicas' start, checkpoint read and
compile included) and once started (the tokens over the replicas' busy time), and the driver's CPU
time per block (Ray Data's executor and the result rows: what the one driver spends
on every block whatever the cluster's size).

Where scaling stops: the driver's CPU time, fitted over the jobs as idle x wall + per_block x
blocks, reaches one core at (1 - idle) / per_block blocks a second; a host of the 2-replica kind
finishes (its tokens/s once started) / (tokens per block) blocks a second; beyond N = the first
over the second, hosts wait on the driver (raise --block-size to move N up: the driver's cost is
per block, not per token).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "demo", "model")


def write_prompts(path: str, n: int, max_tokens: int) -> None:
    with open(os.path.join(MODEL, "eval.jsonl")) as f:
        held_out = [json.loads(line)["prompt"] for line in f if line.strip()]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "prompt": held_out[i % len(held_out)],
                                "max_tokens": max_tokens}) + "\n")


def one_job(prompts: str, out: str, replicas: int, cpus: int, a, block_size: int) -> dict:
    from decode.cli import parse_args
    from decode.jobs.ray_job import run_ray_job
    args = parse_args(["--checkpoint", MODEL, "--input", prompts, "--output", out, "--ray", "local",
                       "--replicas", str(replicas), "--replica-cpus", str(cpus),
                       "--block-size", str(block_size), "--slots", str(a.slots),
                       "--no-default-stops", "--no-compile-cache"])
    stats = run_ray_job(args)
    stats["pids"] = sorted(stats["pids"])
    return dict(replicas=replicas, cpus_each=cpus, block_size=block_size, **stats)


def median_run(runs: list) -> dict:
    """One kind of job over the rounds: the median of each figure."""
    import statistics
    keys = ("wall_s", "tokens_per_s", "decode_tokens_per_s", "driver_s_per_block")
    return dict(runs[0], rounds=len(runs), **{k: statistics.median(r[k] for r in runs) for k in keys})


def driver_cost(runs: list) -> tuple[float, float]:
    """(CPU s per wall s, CPU s per block) of the driver: a least-squares fit of every job's
    driver CPU time to idle * wall + per_block * blocks (Ray Data's executor polls while it waits;
    each block costs a task, its result row and its bookkeeping on top)."""
    import numpy as np
    a = np.array([[r["wall_s"], r["blocks"]] for r in runs])
    cpu = np.array([r["driver_s_per_block"] * r["blocks"] for r in runs])
    (idle, per_block), *_ = np.linalg.lstsq(a, cpu, rcond=None)
    return float(idle), float(per_block)


def scaling_bound(runs: list, two: dict, block_size: int, max_tokens: int) -> dict:
    """Hosts (of the 2-replica kind) one driver core can keep busy: idle + per_block x blocks/s
    reaches 1 CPU s per s at N = (1 - idle) / (per_block x a host's blocks/s)."""
    idle, per_block = driver_cost(runs)
    tokens_per_block = block_size * max_tokens
    host_blocks_per_s = two["decode_tokens_per_s"] / tokens_per_block
    return dict(tokens_per_block=tokens_per_block, host_blocks_per_s=host_blocks_per_s,
                driver_idle_cpu_per_s=idle, driver_s_per_block=per_block,
                driver_blocks_per_s=(1 - idle) / max(per_block, 1e-9),
                hosts_before_the_driver_binds=(1 - idle) / max(per_block * host_blocks_per_s, 1e-12))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.doors.ray_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1, help="the four jobs this many times, in turn "
                   "(medians reported)")
    p.add_argument("--out", default=None, help="also write the figures here (JSON)")
    a = p.parse_args(argv)
    import ray
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prompts = os.path.join(tmp, "prompts.jsonl")
            write_prompts(prompts, a.requests, a.max_tokens)
            kinds = [(1, 1, a.block_size), (1, 2, a.block_size), (2, 1, a.block_size), (2, 1, 1)]
            runs = [one_job(prompts, os.path.join(tmp, f"out{rnd}-{i}"), r, c, a, bs)
                    for rnd in range(a.rounds) for i, (r, c, bs) in enumerate(kinds)]
    finally:
        ray.shutdown()
    medians = [median_run([r for r in runs if (r["replicas"], r["cpus_each"], r["block_size"]) == k])
               for k in kinds]
    bound = scaling_bound(runs, medians[2], a.block_size, a.max_tokens)
    for r in medians:
        print(f"{r['replicas']} replica(s) x {r['cpus_each']} core(s), blocks of {r['block_size']}: "
              f"{r['tokens']} tokens, "
              f"{r['tokens_per_s']:.1f} tokens/s over the job ({r['wall_s']:.1f} s, start included), "
              f"{r['decode_tokens_per_s']:.1f} once started; driver "
              f"{1e3 * r['driver_s_per_block']:.1f} ms CPU per block ({r['blocks']} blocks)")
    print(f"driver: {bound['driver_idle_cpu_per_s']:.3f} CPU s per s idle + "
          f"{1e3 * bound['driver_s_per_block']:.1f} ms per block (fit over the jobs) -> "
          f"{bound['driver_blocks_per_s']:.0f} blocks/s on one core; a 2-replica host: "
          f"{bound['host_blocks_per_s']:.2f} blocks/s ({bound['tokens_per_block']} tokens a block) "
          f"-> about {bound['hosts_before_the_driver_binds']:.0f} such hosts before the driver binds")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(machine=f"{os.cpu_count()}-core {platform.machine()} CPU",
                           date=time.strftime("%Y-%m-%d"), settings=vars(a), runs=runs,
                           medians=medians, bound=bound), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
