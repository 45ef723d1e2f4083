"""`python -m train.pretokenize --ray local` with two workers writes the rows of one process (same
shards, same checksum), and a bad record in a task stops the run naming it. Ray's servers listen
on every interface of the host, so the test (tests/pretokenize_ray_in_namespace.py) runs in a
network namespace of its own holding only the loopback device (`unshare --net`, as root)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("pyarrow")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSIDE = "WEDLM_TEST_LOOPBACK_ONLY"      # tells the inner file it is inside


def test_pretokenize_ray_in_a_loopback_only_network_namespace():
    inner = os.path.join(ROOT, "tests", "pretokenize_ray_in_namespace.py")
    script = (f"ip link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider "
              f"-p no:xdist {inner}")
    proc = subprocess.run(["unshare", "--net", "sh", "-c", script], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, **{INSIDE: "1"}), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b1 passed", proc.stdout) and "failed" not in proc.stdout, proc.stdout[-2000:]
