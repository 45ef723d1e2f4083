"""wedlm-decode --ray: the batch job on a local Ray cluster (two CPUs, 127.0.0.1) with two replicas
of the demo model. Greedy results equal the single-process job's, every id written once, with one
replica's process killed mid-run (its block retried by a new one) and with the driver killed and
the command rerun (the finished parts kept, not redone); Parquet in and out; bad input refused in
one line before any replica starts.

Ray's servers listen on every interface of the host whatever the node address, so those tests
(tests/ray_in_namespace.py) run in a network namespace of their own holding only the loopback
device (`unshare --net`, as root), started by the test here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("pyarrow")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSIDE = "WEDLM_TEST_LOOPBACK_ONLY"      # tells tests/ray_in_namespace.py it is inside


def test_ray_tests_pass_in_a_loopback_only_network_namespace():
    """tests/ray_in_namespace.py's tests, run by pytest in a fresh network namespace (only `lo`,
    up)."""
    inner = os.path.join(ROOT, "tests", "ray_in_namespace.py")
    script = (f"ip link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider "
              f"-p no:xdist {inner}")
    proc = subprocess.run(["unshare", "--net", "sh", "-c", script], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, **{INSIDE: "1"}), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b3 passed", proc.stdout) and "failed" not in proc.stdout, proc.stdout[-2000:]
