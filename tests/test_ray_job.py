"""wedlm-decode --ray: the batch job on a local Ray cluster (two CPUs, 127.0.0.1) with two replicas
of the demo model. Greedy results equal the single-process job's, every id written once, with one
replica's process killed mid-run (its block retried by a new one) and with the driver killed and
the command rerun (the finished parts kept, not redone); Parquet in and out; bad input refused in
one line before any replica starts.

Ray's servers listen on every interface of the host whatever the node address, so those tests
(tests/ray_in_namespace.py) run in a network namespace of their own holding only the loopback
device (`unshare --net`, as root), started by the test here."""

from __future__ import annotations

import pytest

from tests.processes import in_loopback_namespace

pytest.importorskip("ray")
pytest.importorskip("pyarrow")


def test_ray_tests_pass_in_a_loopback_only_network_namespace():
    """tests/ray_in_namespace.py's tests, run by pytest in a fresh network namespace (only `lo`,
    up)."""
    in_loopback_namespace("ray_in_namespace.py", 4, 1200)
