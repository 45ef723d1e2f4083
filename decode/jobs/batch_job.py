"""Offline batch decoding of a prompt file through the continuous batcher.

    wedlm-decode --checkpoint DIR --input prompts.jsonl --output results.jsonl [--slots 16]

Input: one JSON object per line with `prompt` (a string or a list of token ids) or `messages` (a
chat: the checkpoint's chat template), an optional `id` (string or int; default: the line number)
and optional per-line settings overriding the command line's: max_new_tokens (or max_tokens), stop
(a string or a list of strings) and every Sampling option by name (tau, lam, temperature, top_k,
top_p, min_p, the penalties, logit_bias, seed, sampling_order), and `model`: a LoRA adapter of
--lora-modules (with --enable-lora) or the base. Blank lines are skipped.
Every line is checked (JSON, fields, settings, prompt length against the capacity) before the
checkpoint is read; a bad line is named by its line number and field. As for a single prompt, the
window is no wider than the longest max_new_tokens of the file (`decode.config.useful_window`): a
job of short answers decodes with a narrower window and a capacity sized to its lines.

Output: one JSON line per request, written (flushed and fsynced) as the request finishes, in finish
order: id, text, token_ids, finish_reason ('stop' | 'length'), prompt_tokens, completion_tokens,
cached_tokens (prompt rows reused from earlier requests: --page-size), steps (forwards while the
request was live), token_slots (token slots those forwards processed). A
request the engine fails on is written with finish_reason 'error' and the error, the job goes on
with the others and exits 1 at the end naming how many failed (a rerun does not retry them:
delete their lines to). A stop
string ends the request (host-side: its text is cut before the string, its token_ids end with the
token that completed it, finish_reason 'stop'), as in the OpenAI API.

Counters: at the end the job prints wedlm-serve's metrics of the run on one line after its
progress bar (decode/metrics.py: vllm:prompt_tokens_total, vllm:generation_tokens_total,
vllm:request_success_total, wedlm:tokens_per_forward, wedlm:p_cache, ...; needs prometheus-client,
the serve extra), and with --metrics-file PATH writes them as JSON (several processes: PATH.part-K-of-N).

Resuming: when the output file exists, the ids already in it are skipped, so rerunning the same
command after a crash decodes only what was in flight or not yet started. A torn last line (a crash
mid-write: no newline at the end) is dropped from the file first; any other unreadable line stops
the job without touching the file.

Several processes (`--coordinator-address/--num-processes/--process-id` or the JAX_* environment,
jax.distributed: one process per host, each on its own devices): every process reads and checks
the whole input, takes the lines at positions k, k + N, k + 2N, ... (k its index, N the count) and
writes them to its own part, OUTPUT.part-K-of-N (K and N five digits), resumable as above. When
all have finished, `python -m decode.jobs.batch_job merge OUTPUT [--input INPUT]` joins the parts into
OUTPUT (refused if OUTPUT exists, if a part is missing or torn, or if an id appears twice; with
--input, also if an input id has no result), written beside it and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from decode.config import DecodeConfigError, DoorOptions, Sampling, useful_window
from decode.jobs.lines import id_key, read_input
from wedlm_jax.runtime import interrupts

# ----------------------------------------------------------------------------------- output

def check_output(path: str, input_path: str) -> None:
    """The output must be a file we can append to, and not the input."""
    if os.path.isdir(path):
        raise DecodeConfigError(f"--output {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DecodeConfigError(f"--output {path}: folder {parent} does not exist")
    if os.path.exists(path) and os.path.samefile(path, input_path):
        raise DecodeConfigError(f"--output {path} is the input file")
    if os.path.exists(path) and not os.access(path, os.W_OK) or not os.access(parent, os.W_OK):
        raise DecodeConfigError(f"--output {path} is not writable")


def scan_output(path: str) -> tuple[set, int]:
    """(id keys already written, bytes of a torn last line). Raises on an unreadable complete line."""
    if not os.path.exists(path):
        return set(), 0
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1          # everything after the last newline is a torn write
    done = set()
    for lineno, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            done.add(id_key(obj["id"]))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise DecodeConfigError(f"--output {path}:{lineno} is not a result line of this tool "
                                    "(a JSON object with 'id'); refusing to append to it") from None
    return done, len(data) - end


def drop_torn_tail(path: str, torn: int) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - torn)
        f.flush()
        os.fsync(f.fileno())


def part_path(output: str, k: int, n: int) -> str:
    """Process k of n writes its share of the results here."""
    return f"{output}.part-{k:05d}-of-{n:05d}"


def merge_parts(output: str, input_path: str | None = None) -> int:
    """Join OUTPUT.part-*-of-N into OUTPUT (see the module docstring); returns the lines written.
    Raises DecodeConfigError naming what is wrong; nothing is written then."""
    import glob
    import re
    if os.path.exists(output):
        raise DecodeConfigError(f"{output} exists; merge writes a new file (move it away first)")
    parts = sorted(glob.glob(glob.escape(output) + ".part-*-of-*"))
    counts = {int(m.group(1)) for p in parts if (m := re.search(r"-of-(\d{5})$", p))}
    if not parts or len(counts) != 1:
        raise DecodeConfigError(f"no parts of one job beside {output} (expected {output}.part-K-of-N; "
                                f"found {len(parts)} with {len(counts)} different N)")
    n = counts.pop()
    missing = [k for k in range(n) if part_path(output, k, n) not in parts]
    if missing:
        raise DecodeConfigError(f"part {missing[0]} of {n} is missing ({part_path(output, missing[0], n)}):"
                                " that process has not written anything yet")
    lines, seen = [], set()
    for k in range(n):
        path = part_path(output, k, n)
        ids, torn = scan_output(path)
        if torn:
            raise DecodeConfigError(f"{path} ends in a torn line: rerun process {k} to finish it")
        dup = seen & ids
        if dup:
            raise DecodeConfigError(f"id {sorted(dup)[0]} is in {path} and in an earlier part")
        seen |= ids
        with open(path, "rb") as f:
            lines += [line for line in f.read().split(b"\n") if line.strip()]
    if input_path is not None:
        want = input_ids(input_path)
        left = [i for i in want if i not in seen]
        if left:
            raise DecodeConfigError(f"{len(left)} input id(s) have no result yet (first: {left[0]}); "
                                    "rerun the processes to finish them")
    tmp = output + ".merging"
    with open(tmp, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    return len(lines)


def input_ids(path: str) -> list[str]:
    """The id keys of an input file's non-blank lines (its `id`, else the line number), without
    tokenizing: what a merge checks for completeness."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise DecodeConfigError(f"--input {path}:{lineno}: not a JSON line") from None
                out.append(id_key(obj.get("id", lineno) if isinstance(obj, dict) else lineno))
    return out


def _append(f, record: dict) -> None:
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


# ----------------------------------------------------------------------------------- the job

def run_job(args) -> int:
    """The `--input/--output` path of wedlm-decode. Returns the exit code."""
    from decode.checkpoint import OpenCheckpoint
    from decode.text import split_stop_strings
    from wedlm_jax.runtime import distributed

    if args.output is None:
        raise DecodeConfigError("--input needs --output (the results file; rerunning resumes it)")
    for flag, on in (("--json", args.json), ("--stream", args.stream), ("--trace", args.trace)):
        if on:
            raise DecodeConfigError(f"{flag} does not apply to --input (results go to --output)")
    opts = DoorOptions.from_args(args)    # every option checked once, before anything loads
    placement = opts.placement
    metrics_file = getattr(args, "metrics_file", None)
    counting = job_metrics_available(metrics_file)
    k, n = distributed.initialize(args, "wedlm-decode")   # before anything touches a device
    if n > 1:   # this process decodes on its own devices: new arrays go there, not to process 0's
        import jax
        jax.config.update("jax_default_device", jax.local_devices()[0])
    ckpt = OpenCheckpoint.from_args(args, placement)   # no weights yet
    model_config, tokenizer = ckpt.config, ckpt.tokenizer
    cli_stop_ids, _ = split_stop_strings(tokenizer, args.stop)
    base_ids = list(ckpt.default_stop_ids) + list(args.stop_id) + cli_stop_ids
    base_name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    opts.lora.check_folders(base_name)
    items = read_input(args.input, tokenizer, opts.sampling, list(dict.fromkeys(base_ids)),
                       list(args.stop), args.chat, args.capacity, model_config.vocab_size,
                       opts.engine.constraint_backend, args.tool_call_parser,
                       (tuple(name for name, _ in opts.lora.lora_modules), base_name))
    output = args.output if n == 1 else part_path(args.output, k, n)
    check_output(output, args.input)
    if metrics_file is not None and n > 1:
        metrics_file = part_path(metrics_file, k, n)
    mine = items[k::n]                    # this process's share (every process read every line)
    done, torn = scan_output(output)
    todo = [it for it in mine if id_key(it.id) not in done]
    skipped = len(mine) - len(todo)
    if torn:
        drop_torn_tail(output, torn)
        print(f"wedlm-decode: dropped a torn last line ({torn} bytes) from {output}", file=sys.stderr)
    if skipped:
        print(f"wedlm-decode: {skipped} of {len(mine)} requests already in {output}; "
              f"decoding the other {len(todo)}", file=sys.stderr)
    if not todo:
        print("wedlm-decode: nothing to do", file=sys.stderr)
        return 0
    # from every line, not only those left: a rerun compiles the same programs and decodes alike
    capacity = args.capacity or max(len(it.prompt_ids) + it.sampling.max_new_tokens for it in items)
    window = useful_window(opts.engine.window, opts.engine.method,
                           max(it.sampling.max_new_tokens for it in items))
    opts = dataclasses.replace(opts, engine=opts.engine.replace(window=window))

    from decode.engine.runtime.batcher import Batcher
    decoder = build_decoder(ckpt, opts, capacity)
    if decoder.adapters is not None:
        opts.lora.load_into(decoder.adapters)
    requests = engine_requests(decoder, todo, args.input)
    batcher = Batcher(decoder, window_policy=opts.engine.window_policy)
    metrics = None
    if counting:
        from decode.metrics import ServerMetrics
        metrics = ServerMetrics(batcher, os.path.basename(os.path.normpath(args.checkpoint)),
                                args.method)
    try:
        with open(output, "a", encoding="utf-8") as out:
            stats = decode_all(batcher, todo, requests, tokenizer, lambda r: _append(out, r),
                               metrics=metrics)
    except KeyboardInterrupt:       # every line written is whole (each is flushed as it finishes)
        kept = len(scan_output(output)[0])
        print(f"\nwedlm-decode: interrupted (Ctrl-C): {kept} result(s) kept in {output}; rerun "
              "the same command to decode the rest", file=sys.stderr)
        return 130
    _summary(stats, args, skipped, output)
    if metrics is not None:
        _metrics_summary(metrics, metrics_file)
    if stats["errors"]:
        print(f"wedlm-decode: {stats['errors']} request(s) failed in the engine (finish_reason "
              f"'error' in {output}); the others were written", file=sys.stderr)
        return 1
    return 0


def build_decoder(ckpt, opts: DoorOptions, capacity: int):
    """The job's Decoder: the checkpoint's weights (read now) under the door's plan."""
    from decode.engine.runtime.decoder import Decoder
    from decode.engine.planning.plan import door_plan
    from wedlm_jax.model import layers_stacked
    config, params, mesh = ckpt.load()
    return Decoder(params, door_plan(opts, config, capacity=capacity, mesh=mesh,
                                     mask_token_id=ckpt.mask_token_id,
                                     stacked_params=layers_stacked(params)))


def engine_requests(decoder, items: list, source: str) -> list:
    """The engine's Request of each Item, checked against the decoder (a refusal names
    `source:line`)."""
    from decode.engine.step.state import Request
    requests = []
    for it in items:
        try:
            requests.append(decoder.check_request(Request(prompt=tuple(it.prompt_ids),
                                                          **Sampling.pick(it.sampling),
                                                          automaton=it.automaton)))
        except DecodeConfigError as e:
            raise DecodeConfigError(f"{source}:{it.line}: {e}") from None
    return requests


def job_metrics_available(metrics_file: str | None) -> bool:
    """Whether the job counts (decode.metrics needs prometheus-client, the serve extra):
    without it the job runs uncounted, unless --metrics-file asks for the counts (an error,
    before anything loads). The file's folder is checked here too."""
    try:
        from decode.metrics import check_metrics_file
    except ImportError as e:
        if metrics_file is not None:
            raise DecodeConfigError(f"--metrics-file needs {e.name}: pip install -e '.[serve]'") from None
        return False
    if metrics_file is not None:
        check_metrics_file(metrics_file)
    return True


def _metrics_summary(metrics, path: str | None) -> None:
    """The job's counters on one line after its progress bar (and as JSON in `path`)."""
    from decode.metrics import summary_line, write_metrics_file
    values = metrics.snapshot()
    print(f"wedlm-decode: metrics: {summary_line(values)}", file=sys.stderr)
    if path is not None:
        write_metrics_file(path, values)
        print(f"wedlm-decode: metrics -> {path}", file=sys.stderr)


def tool_calls(item, text: str, finish: str) -> dict:
    """The line's finish_reason, and with tools its content and tool_calls (OpenAI's message
    fields): 'tool_calls' when the output holds calls and ended at its stop."""
    if item.tools is None or item.tools.choice == "none":
        return dict(finish_reason=finish)
    from decode.tools.calls import split_calls
    content, calls = split_calls(item.tools.fmt, text)
    if not calls:
        return dict(finish_reason=finish)
    return dict(finish_reason="tool_calls" if finish == "stop" else finish, content=content,
                tool_calls=calls)


def decode_all(batcher, todo, requests, tokenizer, write, progress: bool = True,
               metrics=None) -> dict:
    """Submit every request, step the batcher until all have finished and hand each result record
    to `write` as it finishes (counted in `metrics`, a ServerMetrics, when given); returns the counts
    (requests, tokens, steps, token_slots, errors, wall_s)."""
    from tqdm import tqdm

    from decode.text import TextStream, stop_at_strings
    live = {}   # request id -> (item, TextStream of its completion, its metrics' Track or None)
    stats = dict(requests=0, tokens=0, steps=0, token_slots=0, tokens_counted=0, wall_s=0.0,
                 errors=0)
    bar = tqdm(total=len(todo), unit="req", desc="wedlm-decode", file=sys.stderr, dynamic_ncols=True,
               disable=not progress)

    def on_tokens(rid, new):
        item, text, _ = live[rid]
        if not text.stopped:
            text.add(new)
            if text.stopped:
                batcher.cancel(rid)

    def on_finish(fin):
        item, text, track = live.pop(fin.request_id)
        if track is not None:
            stopped_here = fin.finish == "cancelled" and text.stopped
            metrics.finished(track, fin, "stop" if stopped_here else None)
        if fin.finish == "error":       # this request alone; the job goes on
            write(dict(id=item.id, text="", token_ids=[], finish_reason="error",
                       error=fin.error, prompt_tokens=len(item.prompt_ids),
                       completion_tokens=0, steps=fin.steps, token_slots=fin.n_fwd))
            stats["errors"] += 1
            bar.update(1)
            return
        ids, text, stopped = stop_at_strings(tokenizer, list(fin.tokens), item.stop_strings)
        finish = "stop" if stopped else fin.finish
        if finish == "cancelled":
            raise RuntimeError(f"request {item.id!r} was cancelled without a stop string")
        write(dict(id=item.id, text=text, token_ids=ids, **tool_calls(item, text, finish),
                   prompt_tokens=len(item.prompt_ids), completion_tokens=len(ids),
                   cached_tokens=fin.cached_tokens, steps=fin.steps,
                   token_slots=fin.n_fwd))
        stats["requests"] += 1
        stats["tokens"] += len(ids)
        if fin.steps:   # a slot cancelled at a stop string may come back without its counts
            stats["steps"] += fin.steps
            stats["token_slots"] += fin.n_fwd
            stats["tokens_counted"] += len(fin.tokens)
        bar.update(1)
        bar.set_postfix_str(f"{stats['tokens'] / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")

    for item, req in zip(todo, requests):
        track = metrics.track(req) if metrics is not None else None
        counted = metrics.counting(track, on_tokens) if metrics is not None else on_tokens
        rid = batcher.submit(req, on_tokens=counted, on_finish=on_finish,
                             **({"adapter": item.adapter} if item.adapter else {}))
        live[rid] = (item, TextStream(tokenizer, item.stop_strings), track)
    t0 = time.perf_counter()
    try:
        with interrupts.graceful():   # Ctrl-C: the chunk in flight ends, its lines written
            while batcher.step():
                interrupts.check()
    finally:
        bar.close()
    stats["wall_s"] = time.perf_counter() - t0
    if batcher.window_policy is not None:      # --window-policy load: the calls per window
        stats["windows"] = dict(sorted(getattr(batcher.window_policy, "chosen", {}).items(), reverse=True))
    if live:
        raise RuntimeError(f"the batcher went idle with {len(live)} requests unfinished")
    return stats


def _summary(stats: dict, args, skipped: int, output: str) -> None:
    n, tok, wall = stats["requests"], stats["tokens"], stats["wall_s"]
    counted = stats["tokens_counted"]   # the tokens of the requests whose forwards are known
    tpf = counted / stats["steps"] if stats["steps"] else 0.0
    pc = counted / stats["token_slots"] if stats["token_slots"] else 0.0
    print(f"[{args.method}] {n} requests ({skipped} skipped), {tok} tokens in {wall:.1f} s (compile "
          f"included): {tok / max(wall, 1e-9):.1f} tokens/s, {tpf:.2f} tokens/forward, p_cache {pc:.3f} "
          f"-> {output}", file=sys.stderr)
    if stats.get("windows"):
        calls = ", ".join(f"W {w}: {n}" for w, n in stats["windows"].items())
        print(f"[{args.method}] device calls per window (--window-policy load): {calls}",
              file=sys.stderr)


def main(argv=None) -> int:
    """`python -m decode.jobs.batch_job merge OUTPUT [--input INPUT]`: join a multi-process job's parts."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m decode.jobs.batch_job",
                                description="join the parts a multi-process batch job wrote")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="OUTPUT.part-K-of-N -> OUTPUT")
    m.add_argument("output")
    m.add_argument("--input", help="also check that every input id has a result")
    args = p.parse_args(argv)
    try:
        n = merge_parts(args.output, args.input)
    except (DecodeConfigError, OSError) as e:
        print(f"merge: error: {e}", file=sys.stderr)
        return 2
    print(f"merge: {n} results -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
