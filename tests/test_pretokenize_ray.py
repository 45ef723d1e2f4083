"""`python -m train.data.pretokenize --ray local` with two workers writes the rows of one process (same
shards, same checksum), and a bad record in a task stops the run naming it. Ray's servers listen
on every interface of the host, so the test (tests/pretokenize_ray_in_namespace.py) runs in a
network namespace of its own holding only the loopback device (`unshare --net`, as root)."""

from __future__ import annotations

import pytest

from tests.processes import in_loopback_namespace

pytest.importorskip("ray")
pytest.importorskip("pyarrow")


def test_pretokenize_ray_in_a_loopback_only_network_namespace():
    in_loopback_namespace("pretokenize_ray_in_namespace.py", 1, 600)
