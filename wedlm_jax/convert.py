"""`wedlm-convert`: Hugging Face safetensors folders <-> this project's Orbax folders.

    wedlm-convert hf-to-orbax --hf DIR --out DIR [--dtype bf16|f32] [--allow-extra] [--force]
                  [--quantize int8|int4 [--quantize-group N]]   (wedlm_jax.checkpoints.quantized)
    wedlm-convert orbax-to-hf --orbax DIR --out DIR [--dtype bf16|f32] [--max-shard-size 5GB] [--force]
    (both: [--allow-nonfinite] to convert weights holding NaN/Inf)
    wedlm-convert lora-merge --hf BASE --lora PEFT_DIR --out DIR [--dtype bf16|f32] [--force]
                  (a PEFT LoRA adapter merged into its base: a Hugging Face folder; wedlm_jax.lora.peft)

The reading and writing is `wedlm_jax.checkpoints`'s; the command checks the output folder, its
free space and the tokenizer before reading any weights, cleans up and exits with one line on
SIGINT / SIGTERM and on a full disk.

Round trip: config.json carries every field of the source's (through the Orbax folder's),
changed only where the conversion changes a value (`dtype` with --dtype); unchanged, it is the
source's file byte for byte. Each safetensors file is laid out as the `safetensors` library lays
it out (tensors by dtype, then by name), so HF -> Orbax -> HF of an unmodified single-file
checkpoint gives every file back byte for byte (tests/test_convert.py). Where it cannot: a
sharded checkpoint is cut again by --max-shard-size in this project's tensor order (its shard
files and model.safetensors.index.json differ from the source's, the tensors do not), and files
other than the weights, config.json and `checkpoints.tensors.TOKENIZER_FILES` are not carried.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from wedlm_jax.checkpoints import quantized
from wedlm_jax.checkpoints import (CheckpointError, load_checkpoint, load_hf_checkpoint,
                                   load_orbax, save_hf_checkpoint, save_orbax)
from wedlm_jax.checkpoints.folders import check_out_dir, remove_dead_partials
from wedlm_jax.checkpoints.tensors import check_tokenizer, params_nbytes, parse_size
from wedlm_jax.config import ConfigError
from wedlm_jax.dtypes import DTYPE_ALIASES, allowed
from wedlm_jax.runtime.failures import (DiskFullError, Interrupted, check_space, check_writable, disk_full,
                                format_bytes, mount_point, raise_interrupted)

__all__ = ["main", "load_checkpoint", "load_hf_checkpoint", "save_hf_checkpoint", "load_orbax",
           "save_orbax", "CheckpointError"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wedlm-convert",
                                description="Convert checkpoints between Hugging Face safetensors "
                                            "and this project's Orbax format.")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-orbax", help="HF safetensors folder -> Orbax folder")
    a.add_argument("--hf", required=True, help="Hugging Face checkpoint folder (safetensors)")
    a.add_argument("--allow-extra", action="store_true",
                   help="skip tensors the model does not use instead of failing")
    a.add_argument("--quantize", default="none", choices=("none", "int8", "int4"),
                   help="write the weights quantized (wedlm_jax.checkpoints.quantized): the "
                        "projections int8 (a scale per output channel) or int4 (a scale per "
                        "--quantize-group inputs), the embedding and LM head int8")
    a.add_argument("--quantize-group", type=int, default=None,
                   help="the group size along each projection's input (default: int4 64, int8 "
                        "per channel)")
    b = sub.add_parser("orbax-to-hf", help="Orbax folder -> HF safetensors folder")
    b.add_argument("--orbax", required=True, help="Orbax checkpoint folder written by hf-to-orbax")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    m = sub.add_parser("lora-merge", help="HF base + PEFT LoRA folder -> merged HF folder")
    m.add_argument("--hf", required=True, help="the base's Hugging Face folder")
    m.add_argument("--lora", required=True, help="PEFT adapter folder (adapter_config.json, "
                                                 "adapter_model.safetensors)")
    m.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    for s in (a, b, m):
        s.add_argument("--out", required=True, help="output folder (created atomically)")
        s.add_argument("--dtype", choices=tuple(DTYPE_ALIASES), default=None, metavar="DTYPE",
                       help=f"parameter dtype of the output: {allowed()} (default: as stored)")
        s.add_argument("--force", action="store_true", help="replace an existing checkpoint at --out")
        s.add_argument("--allow-nonfinite", action="store_true",
                       help="convert weights that hold NaN/Inf instead of refusing")
        s.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    """The command: `_convert` with SIGINT/SIGTERM and a full disk turned into one line each, the
    partial output removed first; exit 130 / 143 (signals) or 2 (errors)."""
    from wedlm_jax.runtime import platforms
    platforms.choose()      # no backend whose hardware is absent (a libtpu lock, a CUDA error)
    import threading
    args = _parser().parse_args(argv)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, raise_interrupted)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    needed = [0]
    try:
        return _convert(args, needed)
    except Interrupted as e:
        # end the process at once after the cleanup: no Orbax / tensorstore writer thread may
        # outlive it (atomic_output_dir removed the partial folder already; this is a second pass)
        _cleanup_line(args.out, f"interrupted by {e}")
        os._exit(130 if str(e) == "SIGINT" else 143)
    except Exception as e:
        if not disk_full(e) is not None:
            raise
        need = f", needed about {format_bytes(needed[0])}" if needed[0] else ""
        _cleanup_line(args.out, f"error: no space left on "
                                f"{mount_point(os.path.abspath(args.out))}{need}")
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _cleanup_line(out: str, message: str) -> None:
    """Remove this process's partial output and print the one-line outcome."""
    remove_dead_partials(os.path.dirname(os.path.abspath(out)), pid=os.getpid())
    print(f"wedlm-convert: {message}; {out} was not changed (partial output removed)",
          file=sys.stderr, flush=True)


def _merge(args, needed: list) -> str:
    """`lora-merge`: the adapter checked against the base's config before the weights load."""
    from wedlm_jax.lora import apply as lora, peft
    from wedlm_jax.config import ModelConfig
    peft.load_peft(args.lora, ModelConfig.from_hf(args.hf))
    config, params = load_hf_checkpoint(args.hf, dtype="f32", progress=not args.no_progress,
                                        allow_nonfinite=args.allow_nonfinite)
    spec, adapters = peft.load_peft(args.lora, config)
    params = lora.fold(params, adapters, spec)
    needed[0] = params_nbytes(params)
    check_space(args.out, needed[0], "the merged checkpoint")
    return save_hf_checkpoint(config, params, args.out, dtype=args.dtype,
                              max_shard_size=args.max_shard_size, tokenizer_from=args.hf,
                              force=args.force, progress=not args.no_progress, config_from=args.hf)


def _convert(args, needed: list) -> int:
    from wedlm_jax.lora.spec import LoraError
    src = args.hf if args.command in ("hf-to-orbax", "lora-merge") else args.orbax
    try:
        if os.path.realpath(src) == os.path.realpath(args.out):
            raise CheckpointError(f"{args.out}: the output folder is the input folder; choose "
                                  f"another --out")
        check_writable(args.out, "--out")
        tokenizer_note = check_tokenizer(src)
        if args.command == "lora-merge":
            check_out_dir(os.path.abspath(args.out), args.force)
            out = _merge(args, needed)
        elif args.command == "hf-to-orbax" and args.quantize != "none":
            check_out_dir(os.path.abspath(args.out), args.force)
            out = quantized.convert_folder(
                args.hf, args.out, args.quantize, args.quantize_group, dtype=args.dtype,
                allow_extra=args.allow_extra, allow_nonfinite=args.allow_nonfinite,
                force=args.force, progress=not args.no_progress, needed=needed)
        elif args.command == "hf-to-orbax":
            check_out_dir(os.path.abspath(args.out), args.force)
            config, params = load_hf_checkpoint(args.hf, dtype=args.dtype,
                                                allow_extra=args.allow_extra,
                                                progress=not args.no_progress,
                                                allow_nonfinite=args.allow_nonfinite)
            needed[0] = params_nbytes(params)
            check_space(args.out, needed[0], "the converted checkpoint")
            out = save_orbax(config, params, args.out, tokenizer_from=args.hf, force=args.force,
                             config_from=args.hf)
        else:
            check_out_dir(os.path.abspath(args.out), args.force)
            quantized.check_exportable(args.orbax)
            parse_size(args.max_shard_size)
            config, params = load_orbax(args.orbax, dtype=args.dtype,
                                        allow_nonfinite=args.allow_nonfinite)
            needed[0] = params_nbytes(params)
            check_space(args.out, needed[0], "the converted checkpoint")
            out = save_hf_checkpoint(config, params, args.out, max_shard_size=args.max_shard_size,
                                     tokenizer_from=args.orbax, force=args.force,
                                     progress=not args.no_progress, config_from=args.orbax)
    except (ConfigError, CheckpointError, DiskFullError, FileNotFoundError, PermissionError,
            LoraError) as e:
        print(f"wedlm-convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}" + (f" ({tokenizer_note})" if tokenizer_note else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
