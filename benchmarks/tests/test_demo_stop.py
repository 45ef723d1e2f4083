"""benchmarks/demo_stop.py: the stop probabilities read from one forward over a whole count equal
those the AR scorer gives each prefix followed by EOS (one sequence per prefix), on the shipped
demo model."""

from __future__ import annotations

import random

import numpy as np

from benchmarks import demo_stop
from decode.scoring import score
from demo.eval import eval_items, load_model
from demo.tasks import counting_parts


def test_stop_probabilities_equal_the_scorer_on_each_prefix():
    config, params, tok = load_model("demo/model")
    items = eval_items("demo/model", "counting")[:3]
    rows = demo_stop.measure(config, params, tok, items)
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
    for it, row in zip(items, rows):
        header, xs, sep = counting_parts(random.Random(it["seed"]))
        seqs = [tok.encode(header + sep.join(xs[:k])) + [eos] for k in range(1, len(xs) + 1)]
        p = np.exp([s["token_logprobs"][-1] for s in score(params, config, seqs)])
        assert row["numbers"] == len(xs) and row["format"] == demo_stop.count_format(header)
        np.testing.assert_allclose(row["p_end"], p[-1], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(row["p_before"], p[:-1].mean(), rtol=1e-4, atol=1e-6)
    s = demo_stop.summarize(rows)
    assert s["all"]["items"] == 3 and sum(v["items"] for k, v in s.items() if k != "all") == 3
    assert "| all | 3 |" in demo_stop.table(s)


def test_a_bad_model_folder_is_one_line(tmp_path, capsys):
    assert demo_stop.main(["--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("demo_stop: ") and "missing" in err[0]
