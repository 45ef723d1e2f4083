"""Whether two trees build the same programs: each program's lowered module (StableHLO without
debug locations) hashed, for a target, without compiling it.

    python benchmarks/compiled/lowered_hashes.py --tree . --compile-for h100 --model 8b
    python benchmarks/compiled/lowered_hashes.py --tree ../old --compile-for v5p --model 8b

Run as a file, not a module: `--tree` (a checkout of any commit) goes first on the import path,
so one copy of this program hashes the programs of the commit it is given. Kernels' serialized IR
holds their source paths: compare trees checked out at paths of equal length (the path itself is
masked), e.g. `git worktree add --detach ../wt-old <commit>` beside `../wt-new`. Equal hashes mean the
compiler is handed the same module, so every figure of the compiled program (memory, bytes
accessed, FLOPs) is equal too; this is how a refactor is shown to change no program at a shape
whose compile would take long (the 8B decode step for v5p compiles in ~27 min on a 2-core VM).

Programs: the decode programs of `benchmarks.compiled.compile_for` (the full set at --model's
shape, capacity 4096, dense cache and, with --page-size, paged; heads over the target's chips) and
the train step of its train row (the 1B class, one 4096-token row, dual stream, remat full).
Prints `name  sha256[:16]` a line each and, with --out, writes them as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys


class Lowered(Exception):
    """Raised in place of compiling: carries the lowered module's hash."""


def _intercept_compile(tree: str, dump: str | None = None):
    """Lowered.compile replaced by: hash the module (and write it to `dump`/<hash>.mlir), with
    the tree's path (which kernels' serialized IR holds) masked by as many `#`s."""
    import jax
    import jax.stages
    jax.config.update("jax_traceback_in_locations_limit", 0)   # kernels' IR: no source lines

    def compile_stop(self, *a, **kw):
        text = self.as_text().replace(tree, "#" * len(tree))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        if dump:
            with open(os.path.join(dump, f"{digest}.mlir"), "w") as f:
                f.write(text)
        raise Lowered(digest)
    jax.stages.Lowered.compile = compile_stop


def _hash_of(fn, *a, **kw) -> str:
    try:
        fn(*a, **kw)
    except Lowered as e:
        return str(e)
    raise RuntimeError(f"{getattr(fn, '__name__', fn)} finished without compiling")


def decode_hashes(config, devices, page_sizes, quick: bool) -> dict:
    try:
        from benchmarks.compiled.compile_for import decode_programs
    except ModuleNotFoundError:     # a tree from before benchmarks/ was grouped
        from benchmarks.compile_for import decode_programs
    from decode.compile import aot
    from decode.config import EngineOptions, Placement
    out = {}
    for page_size in page_sizes:
        tensor = (len(devices) if config.num_kv_heads % len(devices) == 0 and not page_size
                  else 1)
        attention = "tiled" if devices[0].platform == "tpu" else "auto"
        for prog in decode_programs(quick):
            engine = EngineOptions(**prog, capacity=4096)
            placement = Placement(dtype="bfloat16", attention=attention, kv_tile=256,
                                  mesh=(1, 1, tensor), page_size=page_size)
            name = (f"decode {prog['method']} W{prog['window']} refill {prog['refill']} "
                    f"{prog['slots']} slots {'paged ' + str(page_size) if page_size else 'dense'}")
            out[name] = _hash_of(aot.generate_program, config, devices[:tensor], engine,
                                 placement)
    return out


def train_hash(devices) -> dict:
    from benchmarks.shapes import TRAIN_SHAPE
    from train import dry_run
    from train.config import config_from_dict
    cfg = config_from_dict({
        "model": {"config": dict(TRAIN_SHAPE)},
        "data": {"train_files": ["unused.jsonl"], "seq_len": 4096,
                 "global_batch_size": len(devices)},
        "objective": {"kind": "dual_stream", "block_size": 32, "ar_weight": 1.0},
        "mesh": {"data": 1, "fsdp": len(devices), "tensor": 1},
        "compute_dtype": "bf16", "remat": "full", "loss_chunk": 1024}, "the train shape")
    mc = dry_run.model_config_for(cfg)
    return {"train 1B dual stream 4096": _hash_of(dry_run.compile_step, cfg, mc, list(devices))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True, help="the checkout whose programs are hashed")
    p.add_argument("--compile-for", required=True, help="a target, e.g. h100 or v5p")
    p.add_argument("--model", default="8b", help="the decode shape (benchmarks.shapes)")
    p.add_argument("--page-size", type=int, default=0, help="also hash the paged programs")
    p.add_argument("--quick", action="store_true", help="AR and streaming W16 at 8 slots only")
    p.add_argument("--programs", default="decode,train")
    p.add_argument("--out", help="write {name: hash} here as JSON")
    p.add_argument("--dump", help="write each lowered module here, named by its hash")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.tree))
    _intercept_compile(os.path.abspath(args.tree), args.dump)
    from benchmarks.shapes import DECODE_SHAPES, model_config
    from wedlm_jax.runtime.targets import describe_target
    devices, _ = describe_target(args.compile_for)
    wanted = args.programs.split(",")
    hashes = {}
    if "decode" in wanted:
        pages = [0] + ([args.page_size] if args.page_size else [])
        hashes |= decode_hashes(model_config(DECODE_SHAPES[args.model]), devices, pages, args.quick)
    if "train" in wanted:
        hashes |= train_hash(devices)
    for name, h in hashes.items():
        print(f"{name:60s} {h}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
