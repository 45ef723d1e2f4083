"""benchmarks.demo_model.demo_experiments on a demo-shaped model (conftest.py) at toy size (one regime, a few
items): verified streaming gives AR greedy's tokens, the regimes beside the forward cost by W, their
figure and the Markdown report; and the accuracy experiment's "right through the end value" count."""

from __future__ import annotations

import json

import pytest

from benchmarks.demo_model import demo_experiments as de
from benchmarks.demo_model.demo_experiments import through_end


def test_verified_and_regimes_and_their_report(tmp_path, capsys, tiny_demo_model):
    d = str(tmp_path)
    common = ["--kinds", "counting", "--items", "2", "--repeats", "1", "--results", d,
              "--figures", d, "--model", tiny_demo_model]
    assert de.main(["verified", *common]) == 0
    res = json.loads((tmp_path / "demo_verified.json").read_text())
    assert res["meta"]["command"] == ("python -m benchmarks.demo_model.demo_experiments verified --items 2 "
                                      f"--repeats 1 --kinds counting --model {tiny_demo_model}")
    rows = res["results"]["counting"]
    assert rows["ar"]["n_items"] == rows["verified"]["same_as_ar"] == 2   # AR's tokens, per item
    assert rows["ar"]["tokens_per_forward"] == 1.0 < rows["verified"]["tokens_per_forward"]
    assert de.main(["regimes", *common]) == 0
    res = json.loads((tmp_path / "demo_regimes.json").read_text())["results"]
    assert set(res) == {"counting", "forward_ms"}
    assert list(res["forward_ms"]) == ["1", "4", "8", "16", "32"]
    assert res["counting"]["ar"]["speedup_vs_ar"] == 1.0
    assert (tmp_path / "demo_regimes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert de.main(["report", "--results", d]) == 0
    report = capsys.readouterr().out
    assert "### verified: `python -m benchmarks.demo_model.demo_experiments verified" in report
    assert "| counting | verified | 8 | 0.6 | 0.02 | 1 |" in report
    assert "Ceiling over AR at refill 'before'" in report


def test_unknown_regime_is_refused(capsys):
    with pytest.raises(SystemExit):
        de.main(["verified", "--kinds", "counting,poetry"])
    assert "poetry: the regimes are counting, arith, records, code" in capsys.readouterr().err


def test_through_end_counts_right_numbers_whether_or_not_the_count_stops():
    target = "89, 94, 99, 104"
    assert through_end(target, "89, 94, 99, 104")                 # exact
    assert through_end(target, "89, 94, 99, 104, 109, 114")       # right, runs past b
    assert not through_end(target, "89, 94, 99, 1045")            # a longer last number
    assert not through_end(target, "89, 94, 99")                  # stopped early
    assert not through_end(target, "89, 95, 99, 104")             # a wrong number
    assert through_end("a\nb", " a\nb\n")                          # one per line, spaces stripped
