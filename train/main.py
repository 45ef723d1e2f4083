"""`wedlm-train --config configs/NAME.yaml [key=value ...]`: the training program.

Order of work: parse and validate the config; read the tokenizer, resolve the [MASK] id, read,
validate, tokenize and pack every data file (or, with `data.packed_dir`, check a pretokenized folder
and memory-map its shards); resolve the mesh against the device count and the batch. Only then
is anything placed on devices or compiled (`setup`): params (restored from the latest complete
checkpoint, else loaded from `model.from_hf` or `model.from_orbax`, else random), the jitted step
(train/step.py), the loop (train/loop.py). The loop logs loss terms, accuracies, grad norm, lr,
tokens/s and MFU to a JSONL file (and TensorBoard when installed) at the log steps; checkpoints
are saved asynchronously every `checkpoint.every` steps and at the end; `checkpoint.export_hf`
receives the final params in Hugging Face format.

Stopping early: SIGTERM or SIGINT (a preempted VM, a Slurm job's end, Ctrl-C) saves a checkpoint
at the step in flight and exits with 128 + the signal's number (143, 130): the run is not done,
a rerun resumes it exactly; `time_limit_s` saves and exports as at the end (exit 0); a non-finite
loss or gradient norm stops the run naming the step (exit 1), no checkpoint past it written.

Multi-host: with `--coordinator-address/--num-processes/--process-id`, or the environment variables
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or `distributed=true` (cluster
auto-detection: TPU pod slices, Slurm), `jax.distributed.initialize` runs before anything else
touches JAX. See train/README.md for launch lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from wedlm_jax.runtime import interrupts
interrupts.early("wedlm-train", __name__)   # Ctrl-C during the imports below: one line, 130

from train import dry_run  # noqa: E402 (jax-free: the dry run forces devices before JAX starts)
from wedlm_jax.runtime import distributed  # noqa: E402

log = logging.getLogger("wedlm-train")


# ---------------------------------------------------------------------------- setup (no JAX)

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="wedlm-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML config (configs/*.yaml); key=value overrides follow")
    p.add_argument("overrides", nargs="*", help="section.key=value (YAML values), e.g. steps=100")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed data lines instead of stopping")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true",
                   help="also log the INFO lines of the libraries (Orbax, absl)")
    distributed.add_arguments(p)
    p.add_argument("--force", action="store_true",
                   help="replace an existing checkpoint at checkpoint.export_hf")
    dry_run.add_arguments(p)
    return p.parse_intermixed_args(argv)   # overrides may come before and after options


def dry_run_main(args) -> int:
    """`--dry-run`: everything checkable is checked before JAX starts (config, remat, device
    memory, device count), then the devices are forced and the step compiled."""
    from train.config import TrainConfigError
    from train.data.pipeline import DataError
    from wedlm_jax.config import ConfigError
    try:
        if args.device_memory is None or args.device_memory <= 0:
            raise TrainConfigError("--dry-run needs --device-memory GiB (> 0), e.g. 80")
        cfg = config_from_args(args)
        if args.topology is None:
            dry_run.force_host_devices(dry_run.devices_needed(cfg, args.devices))
        return dry_run.run(cfg, args.device_memory, args.devices, args.topology, args.json_out,
                           source=args.config or "the defaults")
    except (TrainConfigError, DataError, ConfigError) as e:
        print(f"wedlm-train: error: {e}", file=sys.stderr)
        return 2


def config_from_args(args):
    """The TrainConfig of the command line: --config, key=value overrides, and the flags."""
    from train.config import load_config
    overrides = list(args.overrides)
    if args.skip_bad_lines:
        overrides.append("data.skip_bad_lines=true")
    if args.no_progress:
        overrides.append("progress=false")
    if getattr(args, "force", False):
        overrides.append("checkpoint.export_force=true")
    return load_config(args.config, overrides)


def prepare(cfg):
    """Everything that can fail on bad input, before any device work: the model config, the
    tokenizer and [MASK] id, the packed data rows, the mesh shape and this process's rows."""
    import jax
    from train.data import pipeline as data_lib
    from train.config import TrainConfigError, mesh_shape, model_config

    mc = model_config(cfg)
    if mc.max_position_embeddings and cfg.data.seq_len > mc.max_position_embeddings:
        log.warning("data.seq_len %d is past the model's max_position_embeddings %d: positions "
                    "beyond it are trained, and decoding refuses them unless --allow-long is given "
                    "(raise model max_position_embeddings to make it the model's own length)",
                    cfg.data.seq_len, mc.max_position_embeddings)
    tok_dir = cfg.data.tokenizer or cfg.model.folder
    if tok_dir is None:
        raise TrainConfigError("data.tokenizer is not set (and there is no model.from_hf or "
                               "model.from_orbax folder to take tokenizer.json from)")
    packed_meta = None
    if cfg.data.packed_dir is not None:
        packed_meta = data_lib.read_packed_meta(cfg.data.packed_dir, seq_len=cfg.data.seq_len)
    else:
        data_lib.check_files(cfg.data.train_files)
    info = data_lib.load_tokenizer(tok_dir)
    mask_id = None
    if cfg.objective.kind != "ar_only":
        mask_id = data_lib.resolve_mask_token_id(mc, info)
        mc = mc.replace(mask_token_id=mask_id)
    from train.step import attention_impl
    attention_impl(cfg)
    shape = mesh_shape(cfg, jax.device_count())
    if packed_meta is not None:
        # pretokenized rows, memory-mapped shard by shard (checked here: meta.json, shard files,
        # seq_len, tokenizer, vocabulary); malformed lines were reported by train.data.pretokenize
        data_lib.check_packed_tokenizer(packed_meta, cfg.data.packed_dir, info, mc.vocab_size)
        if bool(packed_meta.get("append_eos", True)) != cfg.data.append_eos:
            raise data_lib.DataError(
                f"{cfg.data.packed_dir}/meta.json: packed with append_eos="
                f"{packed_meta.get('append_eos')}, but data.append_eos is {cfg.data.append_eos}")
        rows = data_lib.open_packed(cfg.data.packed_dir, packed_meta)
        docs = data_lib.Documents([], [], [], int(packed_meta.get("lines", 0)))
    else:
        docs = data_lib.load_documents(cfg.data.train_files, info, vocab_size=mc.vocab_size,
                                       skip_bad_lines=cfg.data.skip_bad_lines,
                                       append_eos=cfg.data.append_eos)
        rows = data_lib.pack(docs, cfg.data.seq_len, cfg.data.shuffle_seed)
    return {"model_config": mc, "mask_token_id": mask_id, "tokenizer_dir": tok_dir,
            "mesh_shape": shape, "rows": rows, "docs": docs}


# ----------------------------------------------------------------------------------- the run

class MetricsWriter:
    """JSONL (process 0) and TensorBoard when an implementation is installed; with
    `console_steps` (no progress bar: --no-progress, progress=false) each row also as one line on
    stderr, so `log_every` shows on the console as it does in the file."""

    def __init__(self, path: str | None, enabled: bool, console_steps: int = 0):
        self.file = None
        self.tb = None
        self.console_steps = console_steps if enabled else 0      # the run's steps; 0: no line
        if not enabled:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a")
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(os.path.join(os.path.dirname(os.path.abspath(path)), "tb"))

    def write(self, record: dict):
        if self.console_steps:
            print(f"train: step {record['step']}/{self.console_steps} loss {record['loss']:.4f} "
                  f"{record['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self):
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def check_outputs(cfg) -> None:
    """Every output folder, before any work: `checkpoint.dir` is a folder (or absent);
    `checkpoint.export_hf` is local, does not hold (or is not) one of the run's inputs or its
    checkpoint.dir, and passes wedlm-convert's --out guard: not a non-empty folder without a
    checkpoint, an existing checkpoint only with --force (checkpoint.export_force=true)."""
    from train.config import TrainConfigError
    c = cfg.checkpoint
    if c.dir and "://" not in c.dir and os.path.lexists(c.dir) and not os.path.isdir(c.dir):
        raise TrainConfigError(f"checkpoint.dir {c.dir}: exists and is not a folder")
    from wedlm_jax.runtime.failures import check_writable
    for key, path in (("checkpoint.dir", c.dir), ("checkpoint.export_hf", c.export_hf)):
        if path and "://" not in path:
            try:
                check_writable(path, key)
            except PermissionError as e:
                raise TrainConfigError(str(e)) from None
    if not c.export_hf:
        return
    if "://" in c.export_hf:
        raise TrainConfigError(f"checkpoint.export_hf {c.export_hf}: must be a local folder")
    out = os.path.realpath(c.export_hf)
    inputs = {"model.from_hf": cfg.model.from_hf, "model.from_orbax": cfg.model.from_orbax,
              "data.tokenizer": cfg.data.tokenizer,
              "data.packed_dir": cfg.data.packed_dir, "checkpoint.dir": c.dir,
              **{f"data.train_files[{i}]": f for i, f in enumerate(cfg.data.train_files)}}
    for key, path in inputs.items():
        if path and "://" not in path and os.path.commonpath([out, os.path.realpath(path)]) == out:
            what = "is" if os.path.realpath(path) == out else "contains"
            raise TrainConfigError(f"checkpoint.export_hf {c.export_hf} {what} {key} ({path}); "
                                   f"exporting there would replace it. Choose another folder")
    from wedlm_jax.checkpoints.folders import check_out_dir
    check_out_dir(out, c.export_force, force_hint="--force (checkpoint.export_force=true)")


def run(cfg, progress: bool = True) -> dict:
    """Train according to `cfg` (see `_run`), holding the lock of `checkpoint.dir` throughout:
    outputs are checked and the folder locked before anything else."""
    import jax
    from train import checkpoint as ckpt
    check_outputs(cfg)
    lock = None
    if cfg.checkpoint.dir and "://" not in cfg.checkpoint.dir and jax.process_index() == 0:
        lock = ckpt.lock_run_dir(cfg.checkpoint.dir)
    try:
        return _run(cfg, progress)
    finally:
        if lock is not None:
            lock.close()


def _run(cfg, progress: bool = True) -> dict:
    """Train according to `cfg`. Returns {'records': per-step metric dicts of this invocation,
    'state': the final train state, 'model_config': the ModelConfig, 'start_step': the step it
    resumed from (0 when fresh), 'skipped_lines': malformed lines skipped, 'already_done': the
    final checkpoint was there already (nothing trained), 'stopped': why the loop ended (done,
    time_limit, or the signal's name: train/loop.py)}."""
    import jax

    from train import checkpoint as ckpt
    from train.loop import run_loop

    if cfg.checkpoint.dir and cfg.checkpoint.resume:
        # the saved config against this one, before any data is read or any folder touched
        latest = ckpt.check_resume(cfg.checkpoint.dir, cfg.to_dict())
        if latest == cfg.steps and not cfg.checkpoint.export_hf:
            return {"records": [], "state": None, "model_config": None, "start_step": latest,
                    "skipped_lines": [], "already_done": True, "stopped": "done"}
    prep = prepare(cfg)
    loop = setup(cfg, prep, progress)
    try:
        stopped = run_loop(loop)
    finally:
        if loop.bar is not None:
            loop.bar.close()
        loop.writer.close()
        if loop.mgr is not None:
            loop.mgr.wait_until_finished()
    if cfg.checkpoint.export_hf and stopped in ("done", "time_limit"):
        interrupts.say(f"wedlm-train: interrupted (Ctrl-C) while exporting; the checkpoints are "
                       f"kept, {cfg.checkpoint.export_hf} was not written (rerun to export)")
        export_hf(prep["model_config"], loop.state["params"], cfg.checkpoint.export_hf,
                  prep["tokenizer_dir"], jax.process_index() == 0, cfg.checkpoint.export_force, cfg)
    return {"records": loop.records, "state": loop.state, "model_config": prep["model_config"],
            "start_step": loop.start, "skipped_lines": prep["docs"].skipped,
            "already_done": False, "stopped": stopped}


def setup(cfg, prep: dict, progress: bool):
    """The mesh, the state (restored from the latest complete checkpoint, else loaded or random),
    the data iterator at its saved position, the jitted step and the metrics outputs: a Loop."""
    import jax

    from train.data import pipeline as data_lib
    from train import lora as lora_train
    from train import step as step_lib
    from train.loop import Loop
    from wedlm_jax.sharding import make_mesh

    mc, primary = prep["model_config"], jax.process_index() == 0
    if prep["docs"].skipped:
        log.warning("skipped %d malformed line(s) of %d; first: %s", len(prep["docs"].skipped),
                    prep["docs"].num_lines, prep["docs"].skipped[0])
    mesh = make_mesh(*prep["mesh_shape"])
    opt, spec = step_lib.make_optimizer(cfg), lora_train.spec_of(cfg)
    shardings = step_lib.state_shardings(mc, opt, mesh, lora=spec)
    load = lambda sh: initial_params(cfg, mc, mesh, sh, progress and primary)  # noqa: E731
    cfg, base = lora_train.frozen_base(cfg, mc, mesh, load)    # LoRA's, before any restore
    mgr, found = restore(cfg, step_lib.state_shapes(mc, opt, shardings, lora=spec), primary)
    start, state, data_state = found if found is not None else (0, None, None)
    if state is None:
        state = step_lib.init_state(lora_train.initial_adapters(cfg, mc) if spec else
                                    load(shardings), opt, shardings)
    bsh = step_lib.batch_shardings(mesh)
    first_row, local_rows = data_lib.rows_of_process(bsh["tokens"], cfg.data.global_batch_size,
                                                     cfg.data.seq_len)
    it = iter(data_lib.make_pipeline(prep["rows"], cfg.data.global_batch_size,
                                     cfg.data.shuffle_seed, first_row=first_row,
                                     local_rows=local_rows))
    rows = len(prep["rows"]["tokens"])
    if data_state is not None:
        if data_state.get("rows") != rows:
            log.warning("the data now packs into %d rows, the checkpoint's into %s: the data "
                        "order after resuming differs from the interrupted run's", rows,
                        data_state.get("rows"))
        it.set_state(data_state["grain"])
    # MFU only when asked for (log_mfu, or a given peak_flops): the matmul-rate probe would
    # otherwise cost seconds at the start of every run
    peak = cfg.peak_flops or (step_lib.measure_matmul_flops() if cfg.log_mfu else None)
    flops_step = step_lib.model_flops_per_row(mc, cfg.data.seq_len, cfg.objective.kind,
                                              cfg.objective.block_size) * cfg.data.global_batch_size
    return Loop(cfg=cfg, step_fn=step_lib.make_train_step(cfg, mc, opt, mesh, shardings,
                                                          prep["mask_token_id"], base=base),
                state=state, it=it, mgr=mgr, start=start, rows=rows,
                to_batch=lambda local: data_lib.to_global(local, bsh, cfg.data.global_batch_size),
                writer=MetricsWriter(metrics_path(cfg, start, primary), primary,   # no bar: lines
                                     0 if progress and cfg.progress else cfg.steps),
                bar=progress_bar(cfg, start, progress and primary),
                flops_per_peak=flops_step / (peak * jax.device_count()) if peak else None,
                skipped_lines=prep["docs"].skipped)


def restore(cfg, shapes, primary: bool):
    """(checkpoint manager or None, (step, state, data state) of the latest complete checkpoint
    or None). A run with resume=false moves the earlier steps aside first (nothing deleted)."""
    import jax
    from jax.experimental import multihost_utils

    from train import checkpoint as ckpt
    c = cfg.checkpoint
    if not c.dir:
        return None, None
    if not c.resume and primary and "://" not in c.dir:
        ckpt.move_previous(c.dir)  # start fresh: nothing deleted
    mgr = ckpt.make_manager(c.dir, every=c.every, keep=c.keep, async_save=c.async_save)
    if not c.resume:
        return mgr, None
    found = ckpt.restore_latest(mgr, shapes, set_aside=primary)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("wedlm-train: restore")
        mgr.reload()
    if found is not None:
        log.info("resumed from %s/%d", c.dir, found[0])
    return mgr, found


def initial_params(cfg, mc, mesh, shardings, progress: bool):
    """The weights of a fresh run: model.from_hf, model.from_orbax, or random from the seed."""
    from train import step as step_lib
    if cfg.model.from_hf is not None:
        from wedlm_jax.checkpoints import load_hf_checkpoint
        return load_hf_checkpoint(cfg.model.from_hf, mesh=mesh, dtype="f32", progress=progress)[1]
    if cfg.model.from_orbax is not None:
        from wedlm_jax.checkpoints import load_orbax
        return load_orbax(cfg.model.from_orbax, mesh=mesh, dtype="f32")[1]
    return step_lib.init_params_sharded(mc, cfg.seed, shardings)


def metrics_path(cfg, start: int, primary: bool) -> str | None:
    """metrics_file, else <checkpoint.dir>/metrics.jsonl; rows past the restored step dropped."""
    from train import checkpoint as ckpt
    path = cfg.metrics_file
    if path is None and cfg.checkpoint.dir and "://" not in cfg.checkpoint.dir:
        path = os.path.join(cfg.checkpoint.dir, "metrics.jsonl")
    if primary and path:
        ckpt.truncate_metrics(path, start)  # rows past the restored step are redone
    return path


def progress_bar(cfg, start: int, show: bool):
    if not (show and cfg.progress):
        return None
    from tqdm import tqdm
    return tqdm(total=cfg.steps, initial=start, desc="train", dynamic_ncols=True)


def export_hf(mc, params, out_dir, tokenizer_dir, primary: bool, force: bool = False,
              cfg=None) -> None:
    """The final params as a Hugging Face folder (gathered to process 0 when multi-host); a LoRA
    run's adapters as a PEFT folder (train/lora.py)."""
    import jax
    from jax.experimental import multihost_utils
    from wedlm_jax.checkpoints import save_hf_checkpoint
    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(params, tiled=True)
    if primary and cfg is not None and cfg.lora.rank:
        from train.lora import export_peft
        export_peft(cfg, mc, params, out_dir, force)
    elif primary:
        save_hf_checkpoint(mc, params, out_dir, tokenizer_from=tokenizer_dir, force=force,
                           progress=False)
        log.info("exported Hugging Face checkpoint to %s", out_dir)


def kept_line(cfg, then: str) -> str:
    """What a run that stops early leaves behind, in words; `then`: how to go on ("free space and
    rerun the same command", ...), to start again or to resume."""
    directory = cfg.checkpoint.dir if cfg is not None else None
    if not directory or "://" in directory:
        return "nothing was checkpointed"
    from train.checkpoint import complete_steps
    steps = complete_steps(directory)
    if not steps:
        return f"no complete checkpoint in {directory}; {then} to start again"
    return (f"kept the complete checkpoint of step {steps[0]} in {directory} (an unfinished one "
            f"is never resumed from); {then} to resume")


STARTING = ("wedlm-train: interrupted (Ctrl-C) before the first step; no checkpoint was written "
            "by this run")


def main(argv=None) -> int:
    """The command; Ctrl-C ends it with 130 and one line at any moment (wedlm_jax.runtime.interrupts):
    during the steps, after saving the step in flight (train/loop.py); before them, at once."""
    with interrupts.guard("wedlm-train", STARTING):
        return _main(argv)


def _main(argv=None) -> int:
    from wedlm_jax.runtime import platforms
    platforms.choose()      # no backend whose hardware is absent (a libtpu lock, a CUDA error)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if not args.verbose:        # Orbax's and absl's INFO lines (dozens a checkpoint)
        logging.getLogger("absl").setLevel(logging.WARNING)
    refused = dry_run.refusal(args)
    if refused is not None:
        print(f"wedlm-train: error: {refused}", file=sys.stderr)
        return 2
    if args.dry_run:            # before anything imports jax (orbax does): it forces devices
        return dry_run_main(args)
    from train.checkpoint import ResumeError
    from train.config import TrainConfigError
    from train.data.pipeline import DataError
    from train.loop import NonFiniteError
    from wedlm_jax.config import ConfigError
    from wedlm_jax.checkpoints import CheckpointError
    from wedlm_jax.runtime.failures import disk_full, out_of_memory
    cfg = None
    try:
        cfg = config_from_args(args)
        distributed.initialize(args, "wedlm-train", auto=cfg.distributed)
        result = run(cfg, progress=cfg.progress)
        records = result["records"]
    except (TrainConfigError, DataError, ConfigError, CheckpointError, ResumeError) as e:
        print(f"wedlm-train: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"wedlm-train: error: {e}; {kept_line(cfg, 'rerun with that changed')}",
              file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a full disk or memory is one line; anything else a bug
        full, oom = disk_full(e), out_of_memory(e)
        if full is not None:
            then = kept_line(cfg, "free space and rerun the same command")
            print(f"wedlm-train: error: disk full: {full}; {then}", file=sys.stderr)
        elif oom is not None:
            print(f"wedlm-train: error: out of device memory: {oom}; lower data.global_batch_size "
                  "(or raise optimizer.grad_accum) or data.seq_len, or set remat: full and "
                  f"loss_chunk (`--dry-run --device-memory G` checks a config first); "
                  f"{kept_line(cfg, 'rerun with one of these')}", file=sys.stderr)
        else:
            raise
        return 1
    if result.get("already_done"):
        print(f"wedlm-train: {cfg.checkpoint.dir} already holds the final checkpoint (step "
              f"{cfg.steps}) of this run; nothing to train (raise steps to train further)",
              flush=True)
        return 0
    if result["skipped_lines"]:
        print(f"wedlm-train: skipped {len(result['skipped_lines'])} malformed line(s)", flush=True)
    if result["stopped"] in ("SIGTERM", "SIGINT"):      # preempted: saved, not finished
        step = records[-1]["step"] if records else result["start_step"]
        where = (f"saved the checkpoint of step {step} in {cfg.checkpoint.dir}; rerun the same "
                 "command to resume" if cfg.checkpoint.dir else "nothing saved (no checkpoint.dir)")
        print(f"wedlm-train: stopped by {result['stopped']} at step {step} of {cfg.steps}; {where}",
              file=sys.stderr, flush=True)
        return 128 + int(getattr(signal, result["stopped"]))
    if records:
        last = records[-1]
        print(f"wedlm-train: step {last['step']} loss {last['loss']:.4f} "
              f"(mlm {last['mlm_loss']:.4f}, ar {last['ar_loss']:.4f}; accuracy masked "
              f"{last['masked_accuracy']:.3f}, ar {last['ar_accuracy']:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
