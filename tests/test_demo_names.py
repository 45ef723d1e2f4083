"""The records' names (demo/tasks.py recipes): recipe 2 draws them from a space too large for the
tokenizer to give each its own token, and recipe 1, the shipped weights' data, still rebuilds the
shipped held-out items byte for byte."""

from __future__ import annotations

import json
import os
import random

from benchmarks.demo_model.names_check import table_names
from demo import data as dd
from demo import tasks
from demo.eval import DEMO_MODEL


def test_the_shipped_models_items_are_rebuilt_by_its_recipe():
    with open(os.path.join(DEMO_MODEL, "training.json")) as f:
        data = json.load(f)["data"]
    recipe = tasks.recipe_of(data["settings"])
    assert recipe == 1 != tasks.RECIPE
    n = data["eval"]
    items = tasks.heldout_items(data["settings"]["heldout_seed"], n["counting"], n["arith"],
                                n["lists"], n["records"], recipe)
    with open(os.path.join(DEMO_MODEL, "eval.jsonl"), encoding="utf-8") as f:
        shipped = [line.rstrip("\n") for line in f if json.loads(line)["kind"] != "code"]
    assert [json.dumps(it, ensure_ascii=False) for it in items] == shipped


def test_the_name_space_is_large_and_only_the_names_differ():
    space = tasks.all_composed_names()
    assert len(space) > 10_000
    drawn = [tasks.composed_name(random.Random(s)) for s in range(2000)]
    assert set(drawn) <= space and len(set(drawn)) > 1200
    for seed in range(200):
        (p1, a1), (p2, a2) = (tasks.records_problem(random.Random(seed), r) for r in (1, 2))
        rows1, rows2 = ([json.loads(x) for x in a.split("\n")] for a in (a1, a2))
        assert [list(r) for r in rows1] == [list(r) for r in rows2]      # same columns and rows
        assert {r["name"] for r in rows1} <= set(tasks.NAMES)
        assert table_names(p2) == [r["name"] for r in rows2]
        assert {r["name"] for r in rows2} <= space
    assert tasks.recipe_of({}) == 1 and tasks.recipe_of({"recipe": 2}) == 2


def _single_token_share(recipe: int, names, folder) -> float:
    """The pipeline's tokenizer step (demo.data.train_tokenizer, vocab 512) on 1M characters of
    the generated kinds at the default mix: the share of `names` it makes one token."""
    from tokenizers import Tokenizer
    want = {k: 1e6 * v for k, v in dd.DEFAULT_MIX.items() if k in dd.GENERATED}
    docs = [d["text"] for d in dd.generate_all(want, 1, frozenset(), frozenset(), recipe)]
    random.Random(0).shuffle(docs)
    dd.train_tokenizer(docs, str(folder), 512)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return sum(len(tok.encode(n, add_special_tokens=False).ids) == 1 for n in names) / len(names)


def test_names_are_several_tokens_to_the_pipelines_tokenizer(tmp_path):
    new = sorted({tasks.composed_name(random.Random(s)) for s in range(500)})
    assert _single_token_share(2, new, tmp_path / "new") < 0.02
    assert _single_token_share(1, tasks.NAMES, tmp_path / "old") > 0.5
