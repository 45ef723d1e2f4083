"""The batch job on a local Ray cluster (two CPUs, 127.0.0.1) with two replicas of the demo model,
run by tests/test_ray_job.py inside a network namespace holding only the loopback device (Ray's
servers listen on every interface of the host whatever the node address). Not collected by the
suite on its own (its name is not test_*.py): `pytest tests/ray_in_namespace.py` runs it there."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from decode import cli  # noqa: E402
from decode.config import DecodeConfigError  # noqa: E402
from decode.jobs import ray_job  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSIDE = "WEDLM_TEST_LOOPBACK_ONLY"      # set by tests/test_ray_job.py in the namespace it makes
MODEL = os.path.join(ROOT, "demo", "model")
N = 12
SMALL = ["--slots", "4", "--window", "4", "--capacity", "64", "--block-size", "2", "--lazy-compile"]


def prompts():
    words = "one two three four five the cat sat on the mat hello world".split()
    return [{"id": f"r{i}", "prompt": " ".join(words[i % 7: i % 7 + 2 + i % 5]), "max_tokens": 6 + i % 5}
            for i in range(N)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    assert os.environ.get(INSIDE) == "1", "run by tests/test_ray_job.py in its network namespace"
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rayjob")
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts()))
    pq.write_table(pa.Table.from_pylist(prompts()), d / "in.parquet")
    # the replicas' --compile-cache: the test run's own (tests/xla.py), where the reference job
    # in this process has compiled the same programs, else one for this module
    cache = os.environ.get("WEDLM_TEST_COMPILE_CACHE") or str(d / "xla")
    return dict(dir=d, jsonl=str(src), parquet=str(d / "in.parquet"), cache=cache)


@pytest.fixture(scope="module")
def reference(files):
    """The single-process job's records, by id."""
    out = files["dir"] / "single.jsonl"
    argv = ["--checkpoint", MODEL, "--input", files["jsonl"], "--output", str(out)] + SMALL[:6]
    assert cli.main(argv) == 0
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def parts(out) -> list:
    """Every record in the part files of `out` (JSONL or Parquet)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "part-*"))):
        if path.endswith(".parquet"):
            rows += pq.read_table(path).to_pylist()
        else:
            rows += [json.loads(line) for line in open(path)]
    return rows


def same_results(rows, reference):
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(reference) and len(set(ids)) == len(ids)       # each id once
    for r in rows:
        want = reference[r["id"]]
        assert (r["token_ids"], r["text"], r["finish_reason"]) == (
            want["token_ids"], want["text"], want["finish_reason"]), r["id"]


def replica_pids() -> list:
    """The Ray Data actors this test process's cluster runs (its descendants only)."""
    import psutil
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "MapWorker" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def test_bad_input_refused_in_one_line_before_any_replica(cluster, files, tmp_path, capsys):
    base = ["--checkpoint", MODEL, "--input", files["jsonl"], "--ray", cluster]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "one"}\n\n{"prompt": "two", "tau": -1}\n')
    cases = [
        (["--checkpoint", MODEL, "--input", str(bad), "--output", str(tmp_path / "o1"), "--ray", cluster],
         f"{bad}:3: field 'tau'"),
        (base + ["--output", str(tmp_path / "o2"), "--replicas", "3"], "--replicas 3 need 3 CPU"),
        (base + ["--output", files["jsonl"]], "is a file; with --ray it is a folder"),
        (base + ["--output", files["jsonl"] + "/sub"], "is not writable"),
        (["--checkpoint", MODEL, "--input", files["jsonl"], "--output", str(tmp_path / "o3"),
          "--ray", "127.0.0.1:1"], "--ray 127.0.0.1:1: cannot reach the cluster's head"),
    ]
    for argv, message in cases:
        t0 = time.perf_counter()
        assert cli.main(argv) == 2, message
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and err[-1].startswith("wedlm-decode: error:"), (message, err[-1:])
        assert time.perf_counter() - t0 < 60           # refused before any replica started
    assert not replica_pids()
    assert not glob.glob(str(tmp_path / "o*" / "part-*"))
    args = cli.parse_args(["--checkpoint", str(tmp_path / "nowhere"), "--input", files["jsonl"],
                           "--output", str(tmp_path / "o4"), "--ray", cluster])
    with pytest.raises(DecodeConfigError, match="a replica cannot open it"):
        ray_job.probe_checkpoint(args, ray_job.Resources.from_args(args))


def test_two_replicas_one_killed_mid_run_equal_the_single_process_job(cluster, files, reference, tmp_path):
    out = tmp_path / "out"
    killed, running = [], []

    def kill_one_replica_after_the_first_part():
        deadline = time.time() + 300
        while time.time() < deadline and not glob.glob(str(out / "part-*")):
            time.sleep(0.1)
        running.extend(replica_pids())
        if running:
            os.kill(running[0], signal.SIGKILL)
            killed.append(running[0])

    killer = threading.Thread(target=kill_one_replica_after_the_first_part, daemon=True)
    killer.start()
    args = cli.parse_args(["--checkpoint", MODEL, "--input", files["jsonl"], "--output", str(out),
                           "--ray", cluster, "--replicas", "2", "--compile-cache", files["cache"]] + SMALL)
    stats = ray_job.run_ray_job(args)
    killer.join()
    assert killed, "no replica was running when the first part appeared"
    assert stats["requests"] == N and stats["errors"] == 0
    assert len(running) == 2                           # both replicas were up; one was killed
    same_results(parts(out), reference)
    again = ray_job.run_ray_job(args)                  # a rerun finds everything written
    assert again["blocks"] == 0 and again["skipped"] == N


def test_driver_killed_then_rerun_finishes_without_redoing_parts_parquet(cluster, files, reference, tmp_path):
    out = str(tmp_path / "out.parquet")
    argv = ["--checkpoint", MODEL, "--input", files["parquet"], "--output", out, "--ray", cluster,
            "--replicas", "2", "--compile-cache", files["cache"]] + SMALL
    driver = subprocess.Popen([sys.executable, "-m", "decode.cli"] + argv, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and not glob.glob(os.path.join(out, "part-*")) and driver.poll() is None:
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    err = driver.stderr.read().decode()
    driver.stderr.close()
    first = {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(out, "part-*"))}
    assert 0 < len(first) < N // 2, err[-2000:]          # killed with some blocks done, not all
    noisy = "constructor arguments in the object store"     # Ray's error-level line, explained
    assert ray_job.RAY_NOTE in err and (noisy not in err or err.index(ray_job.RAY_NOTE) <
                                         err.index(noisy)), err[-2000:]
    args = cli.parse_args(argv)
    deadline = time.time() + 60                          # the killed job's actors let go of the CPUs
    while time.time() < deadline and ray.available_resources().get("CPU", 0) < 2:
        time.sleep(0.2)
    stats = ray_job.run_ray_job(args)
    assert stats["skipped"] >= 2 * len(first) and stats["requests"] == N - stats["skipped"]
    for p, mtime in first.items():                       # the finished parts were not written again
        assert os.stat(p).st_mtime_ns == mtime
    rows = parts(out)
    same_results(rows, reference)
    assert all(set(r) >= {"id", "text", "token_ids", "finish_reason", "prompt_tokens"} for r in rows)


def test_lines_naming_an_adapter_decode_under_it_on_the_replicas(cluster, files, reference, tmp_path,
                                                                capsys):
    """--enable-lora --lora-modules: each replica loads the adapters; a line's `model` picks one
    (or the base), with the single-process job's results; an unknown name is refused by the
    driver, FILE:LINE."""
    import jax
    import numpy as np

    from decode.checkpoint import OpenCheckpoint
    from decode.config import Placement
    from wedlm_jax.lora import apply as lora_lib
    from wedlm_jax.lora.spec import LoraSpec
    from wedlm_jax.lora.peft import save_peft
    config = OpenCheckpoint.open(MODEL, Placement()).config
    spec = LoraSpec(rank=4, alpha=8.0, targets=("all-linear",))
    rng = np.random.default_rng(1)
    tree = jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(np.float32),
                        lora_lib.adapter_shapes(config, spec))
    folder = save_peft(config, tree, spec, tmp_path / "alpha", base=MODEL)
    lora = ["--enable-lora", "--lora-modules", f"alpha={folder}", "--max-lora-rank", "4"]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "one", "model": "zeta"}) + "\n")
    argv = ["--checkpoint", MODEL, "--input", str(src), "--output", str(tmp_path / "o2"),
            "--ray", cluster] + lora
    assert cli.main(argv) == 2
    assert f"{src}:1: field 'model': 'zeta' is not an adapter" in capsys.readouterr().err
    lines = [dict(p, **({"model": "alpha"} if i % 2 else {})) for i, p in enumerate(prompts()[:6])]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    single = tmp_path / "single.jsonl"
    assert cli.main(["--checkpoint", MODEL, "--input", str(src), "--output", str(single)]
                    + SMALL[:6] + lora) == 0
    adapted = {r["id"]: r for r in map(json.loads, single.read_text().splitlines())}
    out = tmp_path / "out"
    args = cli.parse_args(["--checkpoint", MODEL, "--input", str(src), "--output", str(out),
                           "--ray", cluster, "--replicas", "1", "--compile-cache", files["cache"]]
                          + SMALL + lora)
    assert ray_job.run_ray_job(args)["requests"] == len(lines)
    same_results(parts(out), adapted)
    base = [x["id"] for x in lines if "model" not in x]
    assert all(adapted[i]["token_ids"] == reference[i]["token_ids"] for i in base)
    changed = [x["id"] for x in lines if "model" in x
               and adapted[x["id"]]["token_ids"] != reference[x["id"]]["token_ids"]]
    assert len(changed) >= 2, changed          # the adapter's lines: not the base's tokens
