"""`data.packed_dir` over ArrayRecord shards: the same global batches and the same training losses
(rtol 1e-6) as the earlier .npy layout of the same rows, also across a stop and resume; the checks
before anything compiles name the shard or meta.json at fault."""

import json
import os

import numpy as np
import pytest

from tests.synthetic import train_data as fixtures
from train.data import pipeline as data_lib
from train import main as main_lib
from train.data import packed
from train.data import pretokenize as pt

SEQ = 32
from tests.compiles import COMPILES  # noqa: E402 - every compile (or cache load) here


def write_npy_folder(src: str, out: str) -> None:
    """The rows of packed folder `src` in the earlier .npy layout (what pretokenize wrote before)."""
    meta = data_lib.read_packed_meta(src)
    rows = data_lib.open_packed(src)
    os.makedirs(out)
    start = 0
    shards = []
    for i, s in enumerate(meta["shards"]):
        name = f"shard_{i:05d}"
        for k in rows:
            arr = np.stack([rows[k][j] for j in range(start, start + s["rows"])])
            np.save(packed.npy_shard_path(out, name, k), arr)
        shards.append({"name": name, "rows": s["rows"]})
        start += s["rows"]
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(dict(meta, format=packed.NPY_FORMAT, shards=shards), f)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reader"))
    paths = fixtures.make_tiny_setup(root, num_docs=40)
    paths["ar"] = os.path.join(root, "ar")
    pt.pretokenize([paths["train"], paths["sft"]], paths["tokenizer"], paths["ar"], SEQ,
                   shard_rows=5)
    paths["npy"] = os.path.join(root, "npy")
    write_npy_folder(paths["ar"], paths["npy"])
    return paths


def config(setup, tmp_path, packed_dir, name, **over):
    d = fixtures.tiny_config_dict(setup, **{"data.packed_dir": packed_dir, "steps": 4,
                                            "checkpoint.dir": str(tmp_path / name),
                                            "checkpoint.every": 2, **over})
    del d["data"]["train_files"]
    return fixtures.write_config(str(tmp_path / f"{name}.yaml"), d)


def losses(path: str) -> list[float]:
    return [json.loads(x)["loss"] for x in open(path)]


def test_arrayrecord_batches_equal_npy(setup):
    a, b = data_lib.open_packed(setup["ar"]), data_lib.open_packed(setup["npy"])
    assert isinstance(a["tokens"][0], np.ndarray) and len(a["tokens"]) == len(b["tokens"])
    for first, local in ((0, 8), (4, 4)):
        x = iter(data_lib.make_pipeline(a, 8, 5, first_row=first, local_rows=local))
        y = iter(data_lib.make_pipeline(b, 8, 5, first_row=first, local_rows=local))
        for _ in range(10):
            p, q = next(x), next(y)
            assert p.keys() == q.keys()
            for k in p:
                assert p[k].dtype == q[k].dtype
                np.testing.assert_array_equal(p[k], q[k])


def test_training_losses_equal_npy_and_across_resume(setup, tmp_path, capsys):
    runs = {}
    for name, folder in (("npy", setup["npy"]), ("ar", setup["ar"])):
        assert main_lib.main(["--config", config(setup, tmp_path, folder, name)]) == 0
        runs[name] = losses(str(tmp_path / name / "metrics.jsonl"))
    assert len(runs["ar"]) == 4
    np.testing.assert_allclose(runs["ar"], runs["npy"], rtol=1e-6)
    # stop at step 2, resume to 4: the losses of the uninterrupted run
    assert main_lib.main(["--config", config(setup, tmp_path, setup["ar"], "res"), "steps=2"]) == 0
    assert main_lib.main(["--config", config(setup, tmp_path, setup["ar"], "res")]) == 0
    np.testing.assert_allclose(losses(str(tmp_path / "res" / "metrics.jsonl")), runs["ar"],
                               rtol=1e-6)


def test_checks_name_the_fault_before_compiling(setup, tmp_path, capsys):
    import shutil
    broken = str(tmp_path / "broken")
    shutil.copytree(setup["ar"], broken)
    path = config(setup, tmp_path, broken, "b")

    def error(*over):
        before = len(COMPILES)
        assert main_lib.main(["--config", path, *over]) == 2
        assert len(COMPILES) == before, "compiled something before erroring"
        return capsys.readouterr().err

    with open(os.path.join(broken, "shard_00000_0002.array_record"), "r+b") as f:
        f.truncate(40)
    assert "shard_00000_0002.array_record: unreadable as ArrayRecord" in error()
    shutil.copy(os.path.join(setup["ar"], "shard_00000_0003.array_record"),
                os.path.join(broken, "shard_00000_0002.array_record"))
    meta = json.load(open(os.path.join(broken, "meta.json")))
    meta["shards"][2]["rows"] = 4
    json.dump(meta, open(os.path.join(broken, "meta.json"), "w"))
    assert "shard_00000_0002.array_record: holds 5 rows" in error()
    meta["shards"][2]["rows"] = 5
    json.dump(meta, open(os.path.join(broken, "meta.json"), "w"))
    assert "rows were packed to seq_len 32, but data.seq_len is 64" in error("data.seq_len=64")
    other = fixtures.train_tokenizer(str(tmp_path / "tok2"), vocab_size=80)
    err = error(f"data.tokenizer={other}")
    assert "broken/meta.json: the rows were tokenized with a different tokenizer.json" in err
    os.remove(os.path.join(broken, "meta.json"))
    assert "broken/meta.json: missing (an unfinished `python -m train.data.pretokenize` run" in error()
