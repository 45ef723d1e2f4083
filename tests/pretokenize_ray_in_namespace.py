"""`python -m train.data.pretokenize --ray` on a local two-CPU Ray cluster (127.0.0.1), run by
tests/test_pretokenize_ray.py inside a network namespace holding only the loopback device (Ray's
servers listen on every interface of the host whatever the node address). Not collected by the
suite on its own (its name is not test_*.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os

import pytest

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tests.synthetic import train_data as fixtures  # noqa: E402
from train.data import pipeline as data_lib  # noqa: E402
from train.data import pretokenize as pt  # noqa: E402

INSIDE = "WEDLM_TEST_LOOPBACK_ONLY"      # set by tests/test_pretokenize_ray.py


@pytest.fixture(scope="module")
def cluster():
    assert os.environ.get(INSIDE) == "1", "run by tests/test_pretokenize_ray.py in its namespace"
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    yield
    ray.shutdown()


def checksum(folder: str) -> str:
    rows = data_lib.open_packed(folder)
    h = hashlib.sha256()
    for i in range(len(rows["tokens"])):
        for k in ("tokens", "segment_ids", "maskable"):
            h.update(rows[k][i].tobytes())
    return h.hexdigest()


def test_ray_local_two_workers_write_the_rows_of_one_process(cluster, tmp_path):
    paths = fixtures.make_tiny_setup(str(tmp_path), num_docs=60)
    texts = [json.loads(x) for x in open(paths["train"])]
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in texts[:25]))
    (d / "b.jsonl.gz").write_bytes(gzip.compress("".join(
        json.dumps(r) + "\n" for r in texts[25:40]).encode()))
    pq.write_table(pa.table({"text": [r["text"] for r in texts[40:]]}), d / "c.parquet",
                   row_group_size=4)
    tok, kw = paths["tokenizer"], dict(shard_rows=4, unit_bytes=300)
    one = pt.pretokenize([str(d)], tok, str(tmp_path / "one"), 32, **kw)
    assert one["units"] >= 4
    rc = pt.main([str(d), "--tokenizer", tok, "--out", str(tmp_path / "ray"), "--seq-len", "32",
                  "--shard-rows", "4", "--unit-bytes", "300", "--ray", "local", "--workers", "2"])
    assert rc == 0
    two = data_lib.read_packed_meta(str(tmp_path / "ray"), seq_len=32)
    assert two["packed_by"] == "ray local" and two["shards"] == one["shards"]
    assert checksum(str(tmp_path / "one")) == checksum(str(tmp_path / "ray"))
    # a bad record in one task: one line naming it, nothing read as data
    (d / "z.jsonl").write_text('{"text": "the cat"}\n{"text": 5}\n')
    with pytest.raises(data_lib.DataError, match=r"z\.jsonl:2: field 'text' must be a string"):
        pt.pretokenize([str(d)], tok, str(tmp_path / "bad"), 32, ray="local", workers=2, **kw)
    assert not os.path.exists(tmp_path / "bad" / "meta.json")
