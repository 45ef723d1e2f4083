"""The project's lm-eval tasks run by lm-eval's own CLI against `wedlm-serve` servers on the demo
model, unquantized against `--quantize int8` (and int4), side by side.

    python -m benchmarks.quantized.quantize_lm_eval [--model DIR] [--schemes none,int8[,int4]] [--items N]
                                          [--one-at-a-time] [--out [FILE]]

One server per scheme (`python -m decode.serving.serve`, 127.0.0.1, a free port; the flags
tests/test_lm_eval.py serves with: streaming, W 8, 4 slots, capacity 512, lazy compile), started by
this script and killed by pid when done, on error and on interrupt. For each scheme lm-eval runs
`--model local-completions` (`tokenizer_backend=remote`, 2 concurrent requests) over the three
tasks of tests/lm_eval_tasks/: generate_until with exact match (wedlm_demo_next),
multiple_choice (wedlm_demo_choice) and loglikelihood_rolling (wedlm_demo_documents).

Task data: by default the shipped tasks as they are (16 + 16 + 8 items: one item moves a metric
by 6-12 points). `--items N` builds N items per task of the same three kinds at run time, in a
temporary folder, from the model folder's held-out eval.jsonl (demo.eval.eval_items; nothing is
written under tests/): the next number of each held-out count (the answer is the target's first
entry), the same prompts with the answer among three distractors (numerator -1, +1, +10, as the
shipped items have them) for multiple choice, and whole held-out counts and worked sums (prompt +
target, alternately) as documents.

Reported per task and scheme: lm-eval's metrics, and against the unquantized server the
difference: accuracies in points (x 100); word perplexity in percent of the unquantized one (the
"points" of the documents task), bits per byte as a difference. The target: int8 within 1 point on
every task. Also per item, from lm-eval's logged samples: generations and multiple-choice picks
that differ from the unquantized server's, and the largest change of a log-likelihood.

`--out` writes the JSON (command, machine, date, figures; default
benchmarks/results/quantize/lm_eval_cpu.json); a markdown table is printed either way. A bad
argument (an unknown scheme, --items <= 0 or beyond the held-out items, a missing or damaged
model folder) exits 2 with one line before any server starts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.doors.serve import Server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = os.path.join(ROOT, "tests", "lm_eval_tasks")
DEFAULT_OUT = os.path.join("benchmarks", "results", "quantize", "lm_eval_cpu.json")
SCHEMES = ("none", "int8", "int4")
# task -> (data file, the metric the target is judged on)
TASK_FILES = {"wedlm_demo_next": "next_number.jsonl",
              "wedlm_demo_choice": "next_number_choice.jsonl",
              "wedlm_demo_documents": "documents.jsonl"}
PRIMARY = {"wedlm_demo_next": "exact_match", "wedlm_demo_choice": "acc",
           "wedlm_demo_documents": "word_perplexity"}
ACCURACIES = ("exact_match", "acc")
# tests/test_lm_eval.py's server and client settings
WINDOW, SLOTS, CAPACITY, MAX_LENGTH, CONCURRENT = 8, 4, 512, 500, 2
TARGET_POINTS = 1.0


class BadArgument(Exception):
    """A refusal before any server starts: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not the usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


# ------------------------------------------------------------------------------- task data

def _count_entry(entry: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", entry.strip())
    if not m:
        raise ValueError(f"not a count entry 'n/end': {entry!r}")
    return int(m.group(1)), int(m.group(2))


def next_number_items(counting: list[dict]) -> list[dict]:
    """(prompt, answer) of the next entry of each held-out count in the comma format (the task
    stops at ","; the "one per line" counts are left out): first each count as held out, then each
    one entry further on (the prompt with the target's first entry added), and so on."""
    counts = [(it["prompt"], [e.strip() for e in it["target"].split(",")])
              for it in counting if it["prompt"].endswith(", ") and "\n" not in it["target"]]
    out, k = [], 0
    while any(len(entries) > k for _, entries in counts):
        for prompt, entries in counts:
            if len(entries) > k:
                out.append(dict(prompt=prompt + "".join(e + ", " for e in entries[:k]),
                                answer=entries[k]))
        k += 1
    return out


def _held_out(model: str):
    """(counting items, arith items, next-number items, the most items per task) of eval.jsonl."""
    from demo.eval import eval_items
    counting, arith = eval_items(model, "counting"), eval_items(model, "arith")
    nexts = next_number_items(counting)
    return counting, arith, nexts, min(len(nexts), len(counting) + len(arith))


def build_tasks(model: str, items: int, folder: str, seed: int = 0) -> dict:
    """Write the three tasks (the shipped YAML, N items each of fresh data) into `folder`, from
    `model`'s held-out eval.jsonl; returns {task: item count}."""
    counting, arith, nexts, most = _held_out(model)
    if items > most:
        raise BadArgument(f"--items {items}: the held-out set of {model} gives at most {most} "
                          f"items per task")
    rng = random.Random(seed)
    nxt, choice = nexts[:items], []
    for item in nxt:
        n, end = _count_entry(item["answer"])
        choices = [item["answer"]] + [f"{n + d}/{end}" for d in (-1, 1, 10)]
        rng.shuffle(choices)
        choice.append(dict(prompt=item["prompt"], choices=choices,
                           label=choices.index(item["answer"])))
    n_count = max((items + 1) // 2, items - len(arith))
    n_count = min(n_count, len(counting))
    docs = ([dict(text=it["prompt"] + it["target"]) for it in counting[:n_count]]
            + [dict(text=it["prompt"] + it["target"]) for it in arith[:items - n_count]])
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    for name in os.listdir(TASKS):
        if name.endswith(".yaml"):
            shutil.copyfile(os.path.join(TASKS, name), os.path.join(folder, name))
    for rows, task in ((nxt, "wedlm_demo_next"), (choice, "wedlm_demo_choice"),
                       (docs, "wedlm_demo_documents")):
        with open(os.path.join(folder, "data", TASK_FILES[task]), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return {task: items for task in TASK_FILES}


def shipped_counts() -> dict:
    return {task: sum(1 for line in open(os.path.join(TASKS, "data", name)) if line.strip())
            for task, name in TASK_FILES.items()}


# ------------------------------------------------------------------------------- servers

@contextlib.contextmanager
def servers(model: str, schemes, log_dir: str, jax_platforms: str, start_timeout: float):
    """{scheme: Server} (benchmarks.doors.serve.Server with tests/test_lm_eval.py's flags and the
    scheme's --quantize), all started at once and ready; every one stopped on the way out."""
    flags = ["--slots", str(SLOTS), "--window", str(WINDOW), "--capacity", str(CAPACITY),
             "--lazy-compile", "--no-compile-cache"]
    up = {}
    try:
        for scheme in schemes:
            up[scheme] = Server(model, [*flags, "--quantize", scheme], name=f"the {scheme}",
                                log_path=os.path.join(log_dir, f"server_{scheme}.log"),
                                env={"JAX_PLATFORMS": jax_platforms})
        deadline = time.time() + start_timeout
        for srv in up.values():
            srv.wait_ready(max(1.0, deadline - time.time()))
        yield up
    finally:
        for srv in up.values():
            srv.stop()


# ------------------------------------------------------------------------------- lm-eval

def start_lm_eval(url: str, task_dir: str, out_dir: str) -> subprocess.Popen:
    """lm-eval's CLI over the three tasks against one server (tests/test_lm_eval.py's command),
    started; its output goes to out_dir/lm_eval.log."""
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_HOME=os.path.join(out_dir, "hf"), OPENAI_API_KEY="unused",
               TOKENIZERS_PARALLELISM="false")
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model=demo,base_url={url}/v1/completions,tokenizer_backend=remote,"
            f"tokenized_requests=True,num_concurrent={CONCURRENT},max_retries=1,"
            f"max_length={MAX_LENGTH}",
            "--tasks", ",".join(TASK_FILES), "--include_path", ".",
            "--output_path", os.path.join(out_dir, "results"), "--log_samples"]
    with open(os.path.join(out_dir, "lm_eval.log"), "wb") as log:
        return subprocess.Popen(args, cwd=task_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def run_lm_eval(jobs: dict, task_dir: str, timeout: float, parallel: bool) -> dict:
    """{scheme: seconds}: lm-eval against each {scheme: (url, out_dir)}, one after another or all
    at once; every lm-eval process still running on the way out (error, interrupt, timeout) is
    killed by pid."""
    running, seconds = {}, {}
    try:
        for group in ([list(jobs)] if parallel else [[s] for s in jobs]):
            t0 = time.perf_counter()
            for scheme in group:
                running[scheme] = start_lm_eval(jobs[scheme][0], task_dir, jobs[scheme][1])
            for scheme in group:
                proc = running[scheme]
                left = timeout - (time.perf_counter() - t0)
                try:
                    proc.wait(max(left, 1))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"lm_eval against the {scheme} server ran past "
                                       f"{timeout:g} s") from None
                seconds[scheme] = round(time.perf_counter() - t0, 1)
                if proc.returncode != 0:
                    with open(os.path.join(jobs[scheme][1], "lm_eval.log"), "rb") as f:
                        tail = f.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"lm_eval against the {scheme} server failed "
                                       f"({proc.returncode}):\n{tail}")
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return seconds


def read_results(out_dir: str) -> tuple[dict, dict]:
    """({task: {metric: value}}, {task: [sample rows by doc_id]}) from lm-eval's output folder."""
    files = glob.glob(os.path.join(out_dir, "results", "**", "results_*.json"), recursive=True)
    if len(files) != 1:
        raise RuntimeError(f"expected one lm-eval results file under {out_dir}, found {files}")
    results = json.load(open(files[0]))["results"]
    metrics, samples = {}, {}
    for task in TASK_FILES:
        row = results[task]
        metrics[task] = {k.split(",")[0]: float(v) for k, v in row.items()
                         if "," in k and "stderr" not in k and isinstance(v, (int, float))}
        f, = glob.glob(os.path.join(out_dir, "results", "**", f"samples_{task}_*.jsonl"),
                       recursive=True)
        samples[task] = sorted((json.loads(line) for line in open(f)), key=lambda r: r["doc_id"])
    return metrics, samples


def _loglikelihoods(row) -> list[float]:
    return [float(r[0]) if isinstance(r, (list, tuple)) else float(r)
            for r in (row["filtered_resps"] if isinstance(row["filtered_resps"], list)
                      else [row["filtered_resps"]])]


def per_item(samples: dict, base: dict) -> dict:
    """What changed item by item against the base scheme's samples."""
    out = {}
    gen, ref = samples["wedlm_demo_next"], base["wedlm_demo_next"]
    out["wedlm_demo_next"] = dict(
        differing=[dict(doc_id=r["doc_id"], prompt=r["doc"]["prompt"], answer=r["doc"]["answer"],
                        base=b["filtered_resps"][0], this=r["filtered_resps"][0])
                   for r, b in zip(gen, ref) if r["filtered_resps"][0] != b["filtered_resps"][0]])
    ch, ref = samples["wedlm_demo_choice"], base["wedlm_demo_choice"]
    picks, biggest = [], 0.0
    for r, b in zip(ch, ref):
        lr, lb = _loglikelihoods(r), _loglikelihoods(b)
        biggest = max(biggest, max(abs(x - y) for x, y in zip(lr, lb)))
        pr, pb = max(range(len(lr)), key=lr.__getitem__), max(range(len(lb)), key=lb.__getitem__)
        if pr != pb:
            picks.append(dict(doc_id=r["doc_id"], prompt=r["doc"]["prompt"],
                              choices=r["doc"]["choices"], label=r["doc"]["label"], base=pb,
                              this=pr, base_ll=[round(x, 4) for x in lb],
                              this_ll=[round(x, 4) for x in lr]))
    out["wedlm_demo_choice"] = dict(differing=picks, max_abs_loglikelihood_change=round(biggest, 5))
    docs, ref = samples["wedlm_demo_documents"], base["wedlm_demo_documents"]
    changes = [abs(_loglikelihoods(r)[0] - _loglikelihoods(b)[0]) for r, b in zip(docs, ref)]
    out["wedlm_demo_documents"] = dict(max_abs_loglikelihood_change=round(max(changes), 5),
                                       total_abs_loglikelihood_change=round(sum(changes), 5))
    return out


def differences(results: dict, base: str = "none") -> dict:
    """{scheme: {task: {metric: difference}}}: accuracies in points, word perplexity in percent of
    the base's, the other perplexity metrics as plain differences; `points` is the task's primary
    metric's, `within_target` whether |points| <= 1."""
    diffs = {}
    for scheme, res in results.items():
        if scheme == base:
            continue
        diffs[scheme] = {}
        for task, metrics in res["metrics"].items():
            ref = results[base]["metrics"][task]
            d = {}
            for name, v in metrics.items():
                if name in ACCURACIES:
                    d[name] = round(100 * (v - ref[name]), 2)
                elif name == "word_perplexity":
                    d[name + "_percent"] = round(100 * (v / ref[name] - 1), 3)
                else:
                    d[name] = round(v - ref[name], 5)
            p = PRIMARY[task]
            d["points"] = d[p] if p in ACCURACIES else d[p + "_percent"]
            d["within_target"] = abs(d["points"]) <= TARGET_POINTS
            diffs[scheme][task] = d
    return diffs


def table(report: dict) -> str:
    schemes = list(report["results"])
    head = "| task (items) | metric | " + " | ".join(
        s if s == "none" else f"{s} | {s} - none" for s in schemes) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(schemes) - 1)]
    for task, n in report["items"].items():
        metrics = ([PRIMARY[task]] if PRIMARY[task] in ACCURACIES
                   else ["word_perplexity", "bits_per_byte"])
        for name in metrics:
            cells = [f"{task} ({n})", name]
            for s in schemes:
                v = report["results"][s]["metrics"][task][name]
                cells.append(f"{100 * v:.1f}%" if name in ACCURACIES else f"{v:.4f}")
                if s != "none":
                    d = report["differences"][s][task]
                    cells.append(f"{d[name]:+.2f} pt" if name in ACCURACIES else
                                 f"{d[name + '_percent']:+.3f}%" if name == "word_perplexity"
                                 else f"{d[name]:+.5f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- the run

def check_args(a) -> list[str]:
    schemes = a.schemes.split(",")
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise BadArgument(f"--schemes: unknown scheme {bad[0]!r} (one of {', '.join(SCHEMES)})")
    if len(set(schemes)) != len(schemes):
        raise BadArgument(f"--schemes {a.schemes}: a scheme named twice")
    if "none" not in schemes:
        raise BadArgument("--schemes must include none (the differences are taken against it)")
    schemes = ["none"] + [s for s in schemes if s != "none"]
    if a.items is not None and a.items <= 0:
        raise BadArgument(f"--items {a.items}: must be a positive number of items per task")
    if a.start_timeout <= 0 or a.timeout <= 0:
        raise BadArgument("--start-timeout and --timeout must be positive")
    from demo.eval import DemoModelError, check_model
    try:
        check_model(a.model)
    except DemoModelError as e:
        raise BadArgument(str(e)) from None
    if a.items is not None:
        most = _held_out(a.model)[3]
        if a.items > most:
            raise BadArgument(f"--items {a.items}: the held-out set of {a.model} gives at most "
                              f"{most} items per task")
    import importlib.util
    if importlib.util.find_spec("lm_eval") is None:
        raise BadArgument("lm_eval is not installed (pip install lm-eval)")
    return schemes


def _machine(jax_platforms: str) -> str:
    return f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, JAX_PLATFORMS={jax_platforms}"


def run(a, schemes: list[str], work: str) -> dict:
    if a.items is None:
        task_dir, counts = TASKS, shipped_counts()
    else:
        task_dir = os.path.join(work, "tasks")
        counts = build_tasks(a.model, a.items, task_dir, a.seed)
    results, samples = {}, {}
    groups = [[s] for s in schemes] if a.one_at_a_time else [schemes]
    for group in groups:
        with servers(a.model, group, work, a.platform, a.start_timeout) as up:
            jobs = {s: (up[s].url, os.path.join(work, f"lm_eval_{s}")) for s in group}
            seconds = run_lm_eval(jobs, task_dir, a.timeout, a.parallel and not a.one_at_a_time)
            for scheme in group:
                metrics, samples[scheme] = read_results(jobs[scheme][1])
                results[scheme] = dict(metrics=metrics, lm_eval_seconds=seconds[scheme],
                                       server_start_seconds=up[scheme].start_seconds,
                                       next_wrong=[dict(doc_id=r["doc_id"], prompt=r["doc"]["prompt"],
                                                        answer=r["doc"]["answer"],
                                                        got=r["filtered_resps"][0])
                                                   for r in samples[scheme]["wedlm_demo_next"]
                                                   if not r["exact_match"]])
                print(f"[{scheme}] lm_eval {seconds[scheme]} s: " + json.dumps(
                    {t: round(m[PRIMARY[t]], 4) for t, m in metrics.items()}), flush=True)
    for task, n in counts.items():
        got = {s: len(samples[s][task]) for s in schemes}
        if set(got.values()) != {n}:
            raise RuntimeError(f"{task}: lm-eval scored {got} items, the task has {n}")
    changes = {s: per_item(samples[s], samples["none"]) for s in schemes if s != "none"}
    return dict(items=counts, results=results, differences=differences(results),
                per_item=changes)


def main(argv=None) -> dict:
    from demo.eval import DEMO_MODEL
    ap = _Parser(prog="python -m benchmarks.quantized.quantize_lm_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEMO_MODEL, help="a demo-shaped model folder (default: "
                                                         "the shipped demo model)")
    ap.add_argument("--schemes", default="none,int8", help="comma-separated, from none, int8, "
                                                           "int4; none is the base")
    ap.add_argument("--items", type=int, default=None,
                    help="items per task built from the model's held-out eval.jsonl into a "
                         "temporary folder (default: the shipped tests/lm_eval_tasks)")
    ap.add_argument("--seed", type=int, default=0, help="the order of multiple-choice choices "
                                                        "(with --items)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="one server up at a time (default: all schemes' servers at once)")
    ap.add_argument("--parallel", action="store_true",
                    help="run lm-eval against every server at once (default: one after another, "
                         "so each scheme's seconds are its own)")
    ap.add_argument("--platform", default="cpu", help="JAX_PLATFORMS of the servers")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds the servers may take to answer /ready")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per lm-eval run")
    ap.add_argument("--out", nargs="?", const=DEFAULT_OUT, default=None,
                    help=f"write the JSON here (default with no value: {DEFAULT_OUT})")
    a = ap.parse_args(argv)
    try:
        schemes = check_args(a)
    except BadArgument as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    def _term(signum, frame):   # SIGTERM unwinds like ^C: the servers are stopped on the way out
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, _term)
    t0, load0 = time.time(), os.getloadavg()
    work = tempfile.mkdtemp(prefix="quantize_lm_eval_")
    try:
        figures = run(a, schemes, work)
    except BadArgument as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)
    command = "python -m benchmarks.quantized.quantize_lm_eval" + "".join(
        f" {x}" for x in (sys.argv[1:] if argv is None else argv))
    report = dict(command=command, machine=_machine(a.platform),
                  date=datetime.date.today().isoformat(), model=a.model,
                  tasks="tests/lm_eval_tasks" if a.items is None
                  else f"built from {os.path.join(a.model, 'eval.jsonl')} (--items {a.items}, "
                       f"--seed {a.seed})",
                  server=dict(method="streaming", window=WINDOW, slots=SLOTS, capacity=CAPACITY,
                              flags="--lazy-compile --no-compile-cache"),
                  client=dict(num_concurrent=CONCURRENT, max_length=MAX_LENGTH,
                              lm_eval_runs="at once" if a.parallel and not a.one_at_a_time
                              else "one after another"),
                  target=f"int8 within {TARGET_POINTS:g} point of none on every task (accuracy "
                         f"points; documents: word perplexity, percent)",
                  seconds=round(time.time() - t0, 1),
                  load_average=dict(start=[round(x, 2) for x in load0],
                                    end=[round(x, 2) for x in os.getloadavg()]),
                  **figures)
    print(table(report))
    for scheme, by_task in report["differences"].items():
        missed = [t for t, d in by_task.items() if not d["within_target"]]
        print(f"{scheme}: within {TARGET_POINTS:g} point of none on "
              f"{len(by_task) - len(missed)}/{len(by_task)} tasks"
              + (f" (not: {', '.join(missed)})" if missed else ""))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return report


if __name__ == "__main__":
    main()
