"""Issue 22's cases, run as a user runs them against a checkout: the server (one process, requests
over loopback), wedlm-decode (the three prompt doors) and the training data reader. Per case: the
HTTP status or exit code, the first line of the answer, and what was lost.

    python -m benchmarks.serve_cases --root /path/to/old/checkout --label before --out before.json
    python -m benchmarks.serve_cases --root . --label after --out after.json
    python -m benchmarks.serve_cases --table before.json after.json

`--root` is the checkout whose code runs (PYTHONPATH); the tiny checkpoint and the data files are
made by this checkout (tests.tiny_checkpoint) in a temp folder. Disk-full cases are not here: a
full disk cannot be made without privileges; tests/test_robustness.py injects ENOSPC instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PY = sys.executable
BIG = 2 ** 40


def _env(root):
    return dict(os.environ, PYTHONPATH=os.path.abspath(root), JAX_PLATFORMS="cpu",
                TF_CPP_MIN_LOG_LEVEL="3", WEDLM_COMPILE_CACHE="off")


def _first(text: str) -> str:
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("wedlm-")]
    for ln in [ln for ln in said if ": error:" in ln] + said:      # an error line first
        return ln[:200]
    tb = [ln for ln in lines if ln.startswith("Traceback")]
    if tb:
        last = [x for x in lines if x.split(":")[0].endswith(("Error", "Exception"))]
        return f"Traceback x{len(tb)} ({len(lines)} lines): {last[-1] if last else ''}"[:200]
    return lines[-1][:200] if lines else "(no output)"


def _cli(root, cwd, *args, timeout=300):
    p = subprocess.run([PY, "-m", "decode.cli", *args], cwd=cwd, env=_env(root), capture_output=True,
                       text=True, timeout=timeout)
    return {"rc": p.returncode, "message": _first(p.stderr + p.stdout)}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answer(r) -> dict:
    try:
        body = r.json()
        msg = body.get("error", {}).get("message") if isinstance(body, dict) and "error" in body else \
            json.dumps(body)[:120]
    except ValueError:
        msg = r.text[:120]
    return {"rc": r.status_code, "message": str(msg)[:200]}


# ----------------------------------------------------------------------------------- server

def server_cases(root, work, ckpt, with_soak: bool = True) -> dict:
    import httpx
    port = _free_port()
    proc = subprocess.Popen([PY, "-m", "decode.serve", "--checkpoint", ckpt, "--port", str(port),
                             "--slots", "4", "--window", "8", "--capacity", "256", "--model-name", "tiny",
                             "--no-default-stops", "--shutdown-timeout", "3"],   # every bucket compiled
                            cwd=work, env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.3)
    post = lambda body, **kw: httpx.post(url + "/v1/completions", timeout=300, **kw,
                                         **({} if "content" in kw else {"json": body}))
    ok = {"model": "tiny", "prompt": "the cat sat on", "max_tokens": 8}
    out = {}

    def after(label, send):
        """The answer, then whether the server still serves a normal request and /health."""
        try:
            res = _answer(send())
            good = post(ok)
            res["effect"] = (f"then: completion {good.status_code}, /health "
                             f"{httpx.get(url + '/health', timeout=30).status_code}")
        except httpx.HTTPError as e:
            res = {"rc": type(e).__name__, "message": str(e)[:200]}
        out[label] = res

    def health_during(label, body_bytes: bytes):
        """The request, with /health probed every 50 ms while it runs: the slowest probe."""
        ms, done = [], threading.Event()
        t = threading.Thread(target=probe_health, args=(url, done, ms))
        t.start()
        try:
            res = _answer(post(None, content=body_bytes, headers={"content-type": "application/json"}))
        except httpx.HTTPError as e:
            res = {"rc": type(e).__name__, "message": str(e)[:200]}
        done.set()
        t.join()
        res["effect"] = f"slowest /health during it: {max(ms, default=0.0):.0f} ms"
        out[label] = res

    try:
        after("1a completion with top_k 2**40", lambda: post(dict(ok, top_k=BIG)))
        after("4d JSON nested 100000 deep", lambda: post(None, content=b"[" * 100000 + b"]" * 100000,
                                                         headers={"content-type": "application/json"}))
        after("5a max_tokens past the capacity (256)", lambda: post(dict(ok, max_tokens=1000)))
        after("5b prompt exactly at the capacity", lambda: post(dict(ok, prompt=[5] * 256, max_tokens=None)))
        health_during("3a 5 MB prompt", json.dumps(dict(ok, prompt="the cat " * 655360)).encode())
        health_during("3b 50 MB prompt", json.dumps(dict(ok, prompt="the cat " * 6553600)).encode())
        if with_soak:
            out["6 soak: 160 mixed requests, 6 clients"] = soak(url, proc.pid)
        # 4c: SIGTERM while two long streams run, --shutdown-timeout 3
        streams = []

        def stream():
            lines = []
            try:
                with httpx.stream("POST", url + "/v1/completions", timeout=60,
                                  json=dict(ok, max_tokens=240, stream=True)) as r:
                    for ln in r.iter_lines():
                        lines.append(ln)
            except httpx.HTTPError as e:
                lines.append(f"({type(e).__name__})")
            streams.append(lines)
        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        rc = proc.wait(60)
        log = proc.stdout.read().decode(errors="replace")
        ends = [next((ln for ln in reversed(s) if ln.strip()), "(nothing)")[:40] for s in streams]
        errors = sum(any('"error"' in ln for ln in s) for s in streams)
        out["4c SIGTERM with 2 long streams, --shutdown-timeout 3"] = {
            "rc": rc, "message": f"streams ended with {ends}; {errors} carried an error event",
            "effect": f"{log.count('Traceback')} tracebacks in the server's output"}
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def probe_health(url: str, stop: threading.Event, ms: list) -> None:
    """GET /health every 50 ms until `stop` (one client, kept open: a probe is not charged
    httpx's per-client set-up, tens of ms on a loaded 2-core machine), each latency into `ms`."""
    import httpx
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                c.get(url + "/health")
            except httpx.TransportError:
                pass
            ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.05)


# probe_health in a process of its own: the server's latency without the load generator's
# threads (6 clients building multi-megabyte bodies) competing for the probe's GIL
PROBE = """
import os, sys, threading, time
sys.path.insert(0, sys.argv[3])
from benchmarks.serve_cases import probe_health
stop, ms = threading.Event(), []
t = threading.Thread(target=probe_health, args=(sys.argv[1], stop, ms))
t.start()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
stop.set()
t.join()
print(" ".join(f"{x:.3f}" for x in ms))
"""


def start_probe_process(url: str, stop_file: str):
    """A /health prober in its own process (stop: create `stop_file`, then `finish_probe_process`)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen([PY, "-c", PROBE, url, stop_file, root], stdout=subprocess.PIPE, text=True)


def finish_probe_process(proc) -> list:
    out, _ = proc.communicate(timeout=180)
    return sorted(float(x) for x in out.split())


def _p99(ms: list) -> float:
    return ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else float("nan")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def soak(url: str, pid: int, n: int = 160) -> dict:
    """Mixed valid, invalid, oversized, nested, cancelled and streamed requests from 6 client
    threads against the server process, /health probed every 50 ms from another: the status mix,
    the server's RSS before and after, the probe's p99."""
    import concurrent.futures
    import httpx
    kinds = ["ok", "stream", "bad", "huge", "cancel", "chat", "nested", "long"]
    health, stop = [], threading.Event()

    def one(i):
        kind = kinds[i % len(kinds)]
        with httpx.Client(base_url=url, timeout=120) as c:
            if kind == "ok":
                return c.post("/v1/completions", json={"model": "tiny", "prompt": f"request {i}",
                                                      "max_tokens": 8}).status_code
            if kind == "stream":
                with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": f"s {i}",
                                                               "max_tokens": 8, "stream": True}) as r:
                    list(r.iter_lines())
                    return r.status_code
            if kind == "bad":
                return c.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                      "top_k": BIG}).status_code
            if kind == "huge":
                return c.post("/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"a" * (9 << 20)
                              + b'"}').status_code
            if kind == "cancel":
                try:
                    c.post("/v1/completions", json={"model": "tiny", "prompt": "c", "max_tokens": 200},
                           timeout=0.05)
                except httpx.TimeoutException:
                    pass
                return "cancelled"
            if kind == "chat":
                return c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 6, "messages": [
                    {"role": "user", "content": f"hi {i}"}]}).status_code
            if kind == "nested":
                return c.post("/v1/completions", content=b'{"model": "tiny", "prompt": ' + b"[" * 5000
                              + b"]" * 5000 + b"}").status_code
            return c.post("/v1/completions", json={"model": "tiny", "prompt": "z " * 120,
                                                  "max_tokens": 8}).status_code

    rss0 = _rss_mib(pid)
    t = threading.Thread(target=probe_health, args=(url, stop, health))
    t.start()
    stop_file = tempfile.mktemp(prefix="probe-stop-")
    own = start_probe_process(url, stop_file)
    t0 = time.time()
    status: dict = {}
    def safe(i):
        try:
            return one(i)
        except httpx.HTTPError as e:          # the server stopped answering: counted, not fatal
            return type(e).__name__

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for code in pool.map(safe, range(n)):
            status[str(code)] = status.get(str(code), 0) + 1
    stop.set()
    open(stop_file, "w").close()
    t.join()
    apart = finish_probe_process(own)
    os.unlink(stop_file)
    health.sort()
    return {"rc": "", "message": f"{n} requests in {time.time() - t0:.0f} s: {dict(sorted(status.items()))}",
            "effect": f"server RSS {rss0:.0f} -> {_rss_mib(pid):.0f} MiB; /health p99 {_p99(apart):.0f} ms, "
                      f"max {apart[-1] if apart else float('nan'):.0f} ms ({len(apart)} probes from a "
                      f"process of their own); from a thread of the load generator: p99 "
                      f"{_p99(health):.0f} ms, max {health[-1] if health else float('nan'):.0f} ms"}


# ----------------------------------------------------------------------------------- CLI

def cli_cases(root, work, ckpt) -> dict:
    out = {}
    base = ["--checkpoint", ckpt, "--max-new-tokens", "4", "--window", "4"]
    out["1b wedlm-decode --top-k 2**40"] = _cli(root, work, *base, "--prompt", "hi", "--top-k", str(BIG))
    with open(os.path.join(work, "in_big.jsonl"), "w") as f:
        f.write(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
        f.write(json.dumps({"id": "b", "prompt": "hi", "top_k": BIG}) + "\n")
    r = _cli(root, work, *base, "--input", "in_big.jsonl", "--output", "out_big.jsonl")
    r["effect"] = f"results written: {_lines(os.path.join(work, 'out_big.jsonl'))}"
    out["1c --input line 2 with top_k 2**40"] = r
    with open(os.path.join(work, "in_bytes.jsonl"), "wb") as f:
        f.write(b'{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "h\xff"}\n')
    out["2d --input with a non-UTF-8 byte on line 2"] = _cli(root, work, *base, "--input", "in_bytes.jsonl",
                                                             "--output", "out_bytes.jsonl")
    with open(os.path.join(work, "prompts.jsonl"), "w") as f:
        f.write('"one"\n{"prompt": "two"}\n{"prompt": 3}\n')
    out["5d --prompts-file bad line 3"] = _cli(root, work, *base, "--prompts-file", "prompts.jsonl")
    with open(os.path.join(work, "typo.jsonl"), "w") as f:
        f.write('{"prompt": "one", "temprature": 0.7}\n')
    out["5e --prompts-file key typo 'temprature'"] = _cli(root, work, *base, "--prompts-file", "typo.jsonl")
    return out


def _lines(path):
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


# ----------------------------------------------------------------------------------- data

def data_cases(root, work, ckpt) -> dict:
    """`train.pretokenize` (the same line reader as training) over files with one bad byte."""
    out = {}
    for n, bad in ((100, 57), (2000, 900)):
        path = os.path.join(work, f"docs_{n}.jsonl")
        with open(path, "wb") as f:
            for i in range(1, n + 1):
                f.write(b'{"text": "caf\xe9 line"}\n' if i == bad else
                        json.dumps({"text": f"document {i}"}).encode() + b"\n")
        for mode in ("skip", "strict"):
            dest = os.path.join(work, f"packed_{n}_{mode}")
            args = [PY, "-m", "train.pretokenize", path, "--tokenizer", ckpt, "--out", dest,
                    "--seq-len", "32"] + (["--skip-bad-lines"] if mode == "skip" else [])
            p = subprocess.run(args, cwd=work, env=_env(root), capture_output=True, text=True,
                               timeout=300)
            text = p.stdout + p.stderr
            said = [ln for ln in text.splitlines() if ln.startswith("pretokenize:")]
            out[f"2{'a' if n == 100 else 'b'} pretokenize {n} lines, bad byte on line {bad}, {mode}"] = {
                "rc": p.returncode, "message": (said[0] if said else _first(text))[:200],
                "effect": (said[-1][:160] if len(said) > 1 else "") + f" ({n - 1} good lines in the file)"}
    return out


# ----------------------------------------------------------------------------------- a full disk

def _mount_tmpfs(path: str, size: str, remount: bool = False) -> bool:
    opts = f"remount,size={size}" if remount else f"size={size}"
    args = ["mount", "-o", opts, path] if remount else ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path]
    return subprocess.run(args, capture_output=True).returncode == 0


def disk_cases(root, work, ckpt) -> dict:
    """A really full filesystem (a small tmpfs; needs root, else skipped): the batch job's results
    and training's checkpoints written there, then the same command again once there is room."""
    os.makedirs(disk := os.path.join(work, "disk"), exist_ok=True)
    if os.geteuid() != 0 or not _mount_tmpfs(disk, "8k"):
        return {}
    out = {}
    try:
        src = os.path.join(work, "in_disk.jsonl")
        with open(src, "w") as f:
            f.writelines(json.dumps({"id": i, "prompt": f"line {i}", "max_tokens": 2}) + "\n" for i in range(80))
        dest = os.path.join(disk, "out.jsonl")
        args = ["--checkpoint", ckpt, "--input", src, "--output", dest, "--slots", "4", "--capacity", "32"]
        r = _cli(root, work, *args)
        kept = _lines(dest)
        _mount_tmpfs(disk, "1m", remount=True)
        again = _cli(root, work, *args)
        ids = [json.loads(x)["id"] for x in open(dest)]
        r["effect"] = (f"{kept} complete result lines kept; with room, the same command: exit {again['rc']}, "
                       f"{len(ids)} results, {len(set(ids))} distinct ids of 80")
        out["4b batch job results on a full disk (8 KB tmpfs)"] = r
        sys.path.insert(0, os.path.abspath(root))
        from tests.synthetic import train_data
        paths = train_data.make_tiny_setup(os.path.join(work, "train_data"), num_docs=16)
        ck = os.path.join(disk, "ck")
        cfg = train_data.write_config(os.path.join(work, "disk_cfg.yaml"), train_data.tiny_config_dict(
            paths, **{"steps": 2, "checkpoint.dir": ck, "checkpoint.every": 2, "checkpoint.async_save": False}))
        train = lambda *extra: subprocess.run([PY, "-m", "train.main", "--config", cfg, *extra], cwd=work,
                                              env=_env(root), capture_output=True, text=True, timeout=600)
        os.unlink(dest)
        _mount_tmpfs(disk, "64m", remount=True)
        first = train()
        st = os.statvfs(disk)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        _mount_tmpfs(disk, str(int(used * 1.4) // 4096 * 4096 + 4096), remount=True)
        p = train("steps=4")
        kept = sorted(int(d) for d in os.listdir(ck) if d.isdigit())
        res = {"rc": p.returncode, "message": _first(p.stderr + p.stdout)}
        _mount_tmpfs(disk, "64m", remount=True)
        again = train("steps=4")
        res["effect"] = (f"the first run (to step 2) exit {first.returncode}; {used // 1024} KiB used, the "
                         f"disk resized to 1.4x; checkpoints after the stop: {kept}; tracebacks: "
                         f"{(p.stdout + p.stderr).count('Traceback')}; with room, the same command: "
                         f"exit {again.returncode}, checkpoints then: "
                         f"{sorted(int(d) for d in os.listdir(ck) if d.isdigit())}")
        out["4a training checkpoints on a full disk (tmpfs, room for one)"] = res
    finally:
        subprocess.run(["umount", "-l", disk], capture_output=True)
    return out


def run_all(root, label, soak_too: bool = True) -> dict:
    work = tempfile.mkdtemp(prefix=f"serve-cases-{label}-")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)
    from tests.tiny_checkpoint import make_checkpoint
    ckpt, _, _ = make_checkpoint(os.path.join(work, "ckpt"))
    results = {}
    results.update(data_cases(root, work, ckpt))
    results.update(cli_cases(root, work, ckpt))
    results.update(disk_cases(root, work, ckpt))
    results.update(server_cases(root, work, ckpt, soak_too))
    return results


def table(before: dict, after: dict) -> str:
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    cell = lambda r: esc(r.get("message", "")) + (f" — {esc(r['effect'])}" if r.get("effect") else "")
    rows = ["| case | before | before: answer / effect | after | after: answer / effect |",
            "|---|---|---|---|---|"]
    for case in sorted(set(before) | set(after)):
        b, a = before.get(case, {}), after.get(case, {})
        rows.append(f"| {case} | {b.get('rc', '')} | {cell(b)} | {a.get('rc', '')} | {cell(a)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".")
    p.add_argument("--label", default="run")
    p.add_argument("--out")
    p.add_argument("--table", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--no-soak", action="store_true", help="skip the soak (a checkout that answers "
                   "slowly under it can take very long)")
    args = p.parse_args(argv)
    if args.table:
        print(table(*(json.load(open(f)) for f in args.table)))
        return 0
    results = run_all(args.root, args.label, not args.no_soak)
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
