"""MaskBench (guidance-ai/jsonschemabench's maskbench protocol) on this project's constraint
compiler: for each JSON schema, does the token mask the decoder would apply let every valid
instance through and stop every invalid one, and how long do the compile and the masks take.

    python -m benchmarks.structured.maskbench DIR_OR_TAR... --tokenizer DIR [--backend auto|device|host]
                                   [--timeout 20] [--limit N] [--seed 0] [--out FILE.json]

Inputs: folders (searched recursively) or .tar.xz / .tar.gz archives of JSON files, each
`{"schema": ..., "tests": [{"data": ..., "valid": bool}, ...]}` (/work/shared/data/
maskbench-dev.tar.xz: MaskBench's dev split). `--limit N`: a random sample of N files over all
inputs (names sorted, then `random.Random(seed).sample`).

Per schema, in a worker process (spawned; it loads the tokenizer once) under `--timeout` seconds
for compile and walk together (past it the worker is killed and a new one started):
  compile  `Constraint.json_schema` + `decode.constraints.backends.compile_for(backend=...)`,
           timed (compile_ms); a DecodeConfigError is a "compile error" (its message recorded)
  walk     each test's `json.dumps(data, ensure_ascii=False)`, encoded by the tokenizer, fed to
           the compiled constraint's matcher: each token must be in `allowed()` (each call timed:
           mask µs per token, per backend) and `advance` must return True; a valid instance must
           end `accepting()`
The schemas follow one another in the worker as new schemas reach a server: a device-table build
the auto backend stopped waiting for (compile_for's budget) goes on in the background, and while
it runs compile_for gives the next exact schemas to the host at once (they do not queue behind it).
Status (MaskBench's): "passing" (every valid instance accepted, every invalid one rejected),
"validation error" (a valid instance rejected; reported before an invalidation error), "invalidation
error" (an invalid instance accepted), "compile error", "timeout". An exception other than a
DecodeConfigError at compile is a compile error marked `unexpected` (a bug to look at).

Prints the status counts and percentages, per backend, compile ms p50/p90/p99 and mask µs per
token p50/p99 per backend; `--out` writes them as JSON with every schema's row. Bad input (a
missing path, a file without schema / tests, an unreadable tokenizer folder) is one line on
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import random
import shlex
import sys
import tarfile
import time

import numpy as np

STATUSES = ("passing", "compile error", "timeout", "validation error", "invalidation error")
BACKEND_CHOICES = ("auto", "device", "host")
START_TIMEOUT_S = 300.0          # a worker's imports and tokenizer load


class BadInput(Exception):
    """Input the benchmark cannot run on: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not the usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


# ------------------------------------------------------------------------------------ inputs

def _checked(name: str, text: bytes | str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise BadInput(f"{name}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or "schema" not in doc or not isinstance(doc.get("tests"), list):
        raise BadInput(f"{name}: not a MaskBench file (needs \"schema\" and a \"tests\" list)")
    for i, t in enumerate(doc["tests"]):
        if not isinstance(t, dict) or "data" not in t or not isinstance(t.get("valid"), bool):
            raise BadInput(f"{name}: tests[{i}] needs \"data\" and a boolean \"valid\"")
    return doc


def _from_tar(path: str, wanted=None) -> dict:
    """{member base name: text} of the archive's .json files (only `wanted` names if given)."""
    out = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for m in tar:
                name = os.path.basename(m.name)
                if m.isfile() and name.endswith(".json") and (wanted is None or name in wanted):
                    out[name] = tar.extractfile(m).read()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BadInput(f"{path}: cannot read the archive ({e})") from None
    return out


def _from_dir(path: str) -> dict:
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            if f.endswith(".json"):
                full = os.path.join(root, f)
                rel = os.path.relpath(full, path)
                with open(full, "rb") as fh:
                    out[rel] = fh.read()
    return out


def load_inputs(paths, limit: int | None = None, seed: int = 0) -> list[tuple[str, dict]]:
    """[(file name, MaskBench document)] of every input (folders, archives), names sorted; with
    `limit`, a `random.Random(seed)` sample of that many. Raises BadInput."""
    texts = {}
    for p in paths:
        if os.path.isdir(p):
            found = _from_dir(p)
        elif os.path.isfile(p) and (".tar" in os.path.basename(p) or p.endswith(".tgz")):
            found = _from_tar(p)
        elif os.path.isfile(p) and p.endswith(".json"):
            with open(p, "rb") as fh:
                found = {os.path.basename(p): fh.read()}
        else:
            raise BadInput(f"{p}: no such folder, archive or JSON file")
        if not found:
            raise BadInput(f"{p}: no .json files in it")
        for name, text in found.items():
            if name in texts:
                raise BadInput(f"{name}: given twice (in {p} and an earlier input)")
            texts[name] = text
    names = sorted(texts)
    if limit is not None:
        if limit < 1:
            raise BadInput(f"--limit must be >= 1, got {limit}")
        names = random.Random(seed).sample(names, min(limit, len(names)))
    return [(n, _checked(n, texts[n])) for n in names]


def check_tokenizer(folder: str):
    """The tokenizer of `folder` (raises BadInput when it cannot be read)."""
    from wedlm_jax.tokenizer import load_tokenizer
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise BadInput(f"--tokenizer {folder}: no tokenizer.json there")
    try:
        return load_tokenizer(folder)
    except Exception as e:     # noqa: BLE001 - any failure to read is the same refusal
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BadInput(f"--tokenizer {folder}: cannot be read ({first})") from None


# ------------------------------------------------------------------------- one schema's run

def walk(matcher, ids, times: list) -> tuple[int | None, bool]:
    """Feed `ids` to `matcher`, each `allowed()` call timed into `times` (µs): (None when every
    token was allowed and advanced, else the index of the first that was not; accepting at the
    end)."""
    for k, t in enumerate(ids):
        t0 = time.perf_counter()
        mask = matcher.allowed()
        times.append((time.perf_counter() - t0) * 1e6)
        if not (0 <= t < len(mask) and mask[t]) or not matcher.advance(int(t)):
            return k, False
    return None, matcher.accepting()


def _rejected_where(tok, ids, stopped) -> str:
    if stopped is None:
        return "not accepting at the end"
    if stopped < 0:
        return "the matcher failed"
    return f"token {stopped} of {len(ids)} ({tok.decode(ids[stopped:stopped + 1])!r})"


def verdict(tok, compiled, tests, times: list) -> tuple[str, str | None]:
    """(status, error) of `tests` walked through fresh matchers of `compiled`."""
    invalidation = None
    for i, test in enumerate(tests):
        text = json.dumps(test["data"], ensure_ascii=False)
        ids = tok.encode(text)
        try:
            stopped, accepted = walk(compiled.matcher(), ids, times)
        except Exception as e:     # noqa: BLE001 - a matcher failure rejects the instance
            stopped, accepted = -1, False
            text = f"{text[:60]} ({type(e).__name__}: {e})"
        if test["valid"] and not accepted:
            return "validation error", (f"tests[{i}] (valid) rejected, "
                                        f"{_rejected_where(tok, ids, stopped)}: {text[:120]}")
        if not test["valid"] and accepted and invalidation is None:
            desc = test.get("description") or ""
            invalidation = (f"tests[{i}] (invalid) accepted"
                            f"{f' [{desc}]' if desc else ''}: {text[:120]}")
    return ("invalidation error", invalidation) if invalidation else ("passing", None)


def run_schema(tok, doc: dict, backend: str = "auto", budget_s: float = 2.0) -> dict:
    """One MaskBench file in this process: {status, backend, compile_ms, error?, unexpected?,
    mask_us (float32 array, µs per allowed() call)}."""
    from decode.config import DecodeConfigError
    from decode.constraints.backends import compile_for
    from decode.constraints.spec import Constraint
    row = {"status": None, "backend": None, "compile_ms": None}
    times: list = []
    t0 = time.perf_counter()
    try:
        compiled = compile_for(Constraint.json_schema(doc["schema"]), tok, backend=backend,
                               budget_s=budget_s)
    except DecodeConfigError as e:
        row.update(status="compile error", error=str(e))
    except Exception as e:     # noqa: BLE001 - recorded as a compile error, marked for a look
        first = (str(e).strip().splitlines() or [""])[0][:300]
        row.update(status="compile error", error=f"{type(e).__name__}: {first}", unexpected=True)
    row["compile_ms"] = (time.perf_counter() - t0) * 1e3
    if row["status"] is None:
        row["backend"] = getattr(compiled, "backend", "device")
        row["status"], error = verdict(tok, compiled, doc["tests"], times)
        if error:
            row["error"] = error
    row["mask_us"] = np.asarray(times, np.float32)
    return row


# --------------------------------------------------------------------------- worker process

def _serve(conn, tokenizer_dir: str, backend: str, budget_s: float) -> None:
    """The worker: load the tokenizer once, then run the schemas sent until None."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    tok = check_tokenizer(tokenizer_dir)
    conn.send(("ready", tok.vocab_size))
    while True:
        job = conn.recv()
        if job is None:
            return
        row = run_schema(tok, job, backend, budget_s)
        conn.send(row)


class Worker:
    """A spawned worker process that runs one schema at a time under a timeout."""

    def __init__(self, tokenizer_dir: str, backend: str, budget_s: float):
        self.args = (tokenizer_dir, backend, budget_s)
        self.ctx = multiprocessing.get_context("spawn")
        self.proc = self.conn = None
        self.starts = 0

    def start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_serve, args=(child, *self.args))  # not daemonic:
        # it starts the schema-regex child of decode.constraints.schema_regex
        self.proc.start()
        self.starts += 1
        child.close()
        if not self.conn.poll(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"the worker did not start within {START_TIMEOUT_S:g} s")
        try:
            self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the worker exited at start ({self.proc.exitcode})") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join()
        self.proc = self.conn = None

    def run(self, doc: dict, timeout_s: float) -> dict:
        """The schema's row; a timeout kills the worker (a fresh one is started)."""
        if self.proc is None:
            self.start()
        self.conn.send({"schema": doc["schema"], "tests": doc["tests"]})
        if not self.conn.poll(timeout_s):
            self.stop()
            return {"status": "timeout", "backend": None, "compile_ms": None,
                    "error": f"compile + walk over {timeout_s:g} s"}
        try:
            row = self.conn.recv()
        except EOFError:
            code = self.proc.exitcode if self.proc.join(5) is None else None
            self.stop()
            return {"status": "compile error", "backend": None, "compile_ms": None,
                    "error": f"the worker died (exit code {code})", "unexpected": True}
        return row


# ---------------------------------------------------------------------------------- the run

def run_all(docs, tokenizer_dir: str, backend: str = "auto", timeout_s: float = 20.0,
            budget_s: float = 2.0, progress=None) -> tuple[list[dict], dict]:
    """Every (name, doc) through one worker: (rows without mask times, {backend: mask µs})."""
    worker = Worker(tokenizer_dir, backend, budget_s)
    rows, masks = [], {}
    try:
        for i, (name, doc) in enumerate(docs):
            row = worker.run(doc, timeout_s)
            times = row.pop("mask_us", None)
            if times is not None and len(times) and row["backend"]:
                masks.setdefault(row["backend"], []).append(times)
            rows.append({"file": name, **row})
            if progress:
                progress(i + 1, len(docs), rows[-1])
    finally:
        if worker.proc is not None:
            worker.conn.send(None)
            worker.proc.join(10)
        worker.stop()
    return rows, {b: np.concatenate(t) for b, t in masks.items()}


def _pcts(values, qs) -> dict:
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(np.asarray(values, np.float64), q)) for q in qs}


def summarize(rows: list[dict], masks: dict) -> dict:
    """The report's figures: totals, per backend, compile ms and mask µs percentiles."""
    totals = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    per_backend = {}
    for r in rows:
        b = per_backend.setdefault(r["backend"] or "none", {s: 0 for s in STATUSES})
        b[r["status"]] += 1
    compiled = [r["compile_ms"] for r in rows if r["backend"]]
    return {"totals": totals, "per_backend": per_backend,
            "compile_ms": _pcts(compiled, (50, 90, 99)),
            "mask_us": {b: {**_pcts(t, (50, 99)), "tokens": len(t)}
                        for b, t in sorted(masks.items())},
            "unexpected": [r["file"] for r in rows if r.get("unexpected")]}


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(summary: dict) -> str:
    """The printed report (markdown tables)."""
    n = max(1, sum(summary["totals"].values()))
    backends = sorted(summary["per_backend"])
    lines = ["| status | schemas | % | " + " | ".join(backends) + " |",
             "|---|---|---|" + "---|" * len(backends)]
    for s in STATUSES:
        c = summary["totals"][s]
        lines.append(f"| {s} | {c} | {100 * c / n:.1f} | "
                     + " | ".join(str(summary["per_backend"][b][s]) for b in backends) + " |")
    cm = summary["compile_ms"]
    lines += ["", (f"compile ms (schemas that compiled): p50 {_fmt(cm['p50'])}  "
                   f"p90 {_fmt(cm['p90'])}  p99 {_fmt(cm['p99'])}"), "",
              "| backend | masks timed | µs per token p50 | p99 |", "|---|---|---|---|"]
    for b, m in summary["mask_us"].items():
        lines.append(f"| {b} | {m['tokens']} | {_fmt(m['p50'])} | {_fmt(m['p99'])} |")
    bugs = summary["unexpected"]
    if bugs:
        lines += ["", f"unexpected exceptions (bugs) in {len(bugs)} schemas: "
                  + ", ".join(bugs[:8]) + (", ..." if len(bugs) > 8 else "")]
    return "\n".join(lines)


class Progress:
    """Progress lines on stderr: every 200 schemas or 30 s, and each timeout or unexpected
    exception."""

    def __init__(self):
        self.last = time.perf_counter()

    def __call__(self, done: int, total: int, row: dict) -> None:
        odd = row["status"] == "timeout" or row.get("unexpected")
        now = time.perf_counter()
        if odd or done % 200 == 0 or done == total or now - self.last > 30:
            self.last = now
            extra = f" ({row['file']}: {row['status']})" if odd else ""
            print(f"[maskbench] {done}/{total}{extra}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = _Parser(prog="python -m benchmarks.structured.maskbench")
    ap.add_argument("inputs", nargs="+", metavar="DIR_OR_TAR",
                    help="folders or .tar.xz / .tar.gz archives of MaskBench JSON files")
    ap.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json")
    ap.add_argument("--backend", default="auto", choices=BACKEND_CHOICES)
    ap.add_argument("--timeout", type=float, default=20.0,
                    help="seconds per schema, compile and walk (default 20)")
    ap.add_argument("--device-budget", type=float, default=2.0,
                    help="compile_for's budget_s: seconds the auto backend waits for the device "
                         "tables (default 2)")
    ap.add_argument("--limit", type=int, default=None, help="a seeded sample of N files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the report here (JSON)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    if args.timeout <= 0:
        ap.error(f"--timeout must be > 0, got {args.timeout:g}")
    return args


def report(args, rows: list[dict], summary: dict, vocab_size: int, wall_s: float) -> dict:
    return {"totals": summary["totals"], "per_backend": summary["per_backend"],
            "schemas": rows, "compile_ms": summary["compile_ms"], "mask_us": summary["mask_us"],
            "unexpected": summary["unexpected"], "tokenizer": os.path.abspath(args.tokenizer),
            "vocab_size": vocab_size, "backend": args.backend, "timeout_s": args.timeout,
            "limit": args.limit, "seed": args.seed, "wall_s": round(wall_s, 1),
            "inputs": [os.path.abspath(p) for p in args.inputs],
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "python -m benchmarks.structured.maskbench " + shlex.join(args.argv)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    t0 = time.perf_counter()
    try:
        tok = check_tokenizer(args.tokenizer)
        docs = load_inputs(args.inputs, args.limit, args.seed)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    except (BadInput, OSError) as e:
        print(f"python -m benchmarks.structured.maskbench: error: {e}", file=sys.stderr)
        return 2
    rows, masks = run_all(docs, args.tokenizer, args.backend, args.timeout, args.device_budget,
                          None if args.quiet else Progress())
    summary = summarize(rows, masks)
    wall_s = time.perf_counter() - t0
    print(f"MaskBench: {len(rows)} schemas, tokenizer {args.tokenizer} ({tok.vocab_size} "
          f"tokens), backend {args.backend}, timeout {args.timeout:g} s, wall {wall_s:.0f} s\n")
    print(table(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report(args, rows, summary, tok.vocab_size, wall_s), f, indent=1,
                      ensure_ascii=False)
            f.write("\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
