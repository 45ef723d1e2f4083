"""benchmarks.quantized.quantize_lm_eval at toy size: lm-eval's CLI against an unquantized and an int8
`wedlm-serve` on the tiny demo-shaped model, two items per task built from its held-out set (the
metrics of both servers, their differences, the JSON, every server stopped); the task data it
builds; a bad argument refused (exit 2, one line) before any server starts."""

from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from benchmarks.quantized import quantize_lm_eval as q  # noqa: E402


@pytest.fixture
def started(monkeypatch):
    """Every Server the benchmark starts, recorded."""
    servers = []

    class Recorded(q.Server):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            servers.append(self)

    monkeypatch.setattr(q, "Server", Recorded)
    return servers


def test_none_against_int8_through_lm_eval(tmp_path, tiny_demo_model, started):
    out = q.main(["--model", tiny_demo_model, "--schemes", "none,int8", "--items", "2",
                  "--out", str(tmp_path / "lm_eval.json")])
    assert [s.name for s in started] == ["the none", "the int8"]
    assert all(s.proc.poll() is not None for s in started)          # killed when done
    assert out["items"] == {task: 2 for task in q.TASK_FILES}
    assert set(out["results"]) == {"none", "int8"}
    for scheme in ("none", "int8"):
        m = out["results"][scheme]["metrics"]
        assert 0 <= m["wedlm_demo_next"]["exact_match"] <= 1
        assert 0 <= m["wedlm_demo_choice"]["acc"] <= 1
        docs = m["wedlm_demo_documents"]
        assert 1 <= docs["word_perplexity"] < math.inf and 1 <= docs["byte_perplexity"] < math.inf
        assert docs["bits_per_byte"] == pytest.approx(math.log2(docs["byte_perplexity"]), rel=1e-6)
        assert out["results"][scheme]["lm_eval_seconds"] > 0
    d = out["differences"]["int8"]
    for task, name in (("wedlm_demo_next", "exact_match"), ("wedlm_demo_choice", "acc")):
        want = 100 * (out["results"]["int8"]["metrics"][task][name]
                      - out["results"]["none"]["metrics"][task][name])
        assert d[task][name] == pytest.approx(want, abs=0.01) and d[task]["points"] == d[task][name]
    wp = [out["results"][s]["metrics"]["wedlm_demo_documents"]["word_perplexity"]
          for s in ("none", "int8")]
    assert d["wedlm_demo_documents"]["points"] == pytest.approx(100 * (wp[1] / wp[0] - 1), abs=1e-3)
    # int8 weights move the random model's log-likelihoods a little, not nothing
    change = out["per_item"]["int8"]["wedlm_demo_documents"]["max_abs_loglikelihood_change"]
    assert 0 < change < 50
    saved = json.loads((tmp_path / "lm_eval.json").read_text())
    assert saved["results"] == out["results"] and saved["date"] and "core" in saved["machine"]
    assert saved["command"].startswith("python -m benchmarks.quantized.quantize_lm_eval --model")


def test_tasks_built_from_the_held_out_set(tmp_path, tiny_demo_model):
    from demo.eval import eval_items
    counts = q.build_tasks(tiny_demo_model, 60, str(tmp_path))
    assert counts == {task: 60 for task in q.TASK_FILES}
    rows = {t: [json.loads(line) for line in open(tmp_path / "data" / f)]
            for t, f in q.TASK_FILES.items()}
    held = eval_items(tiny_demo_model, "counting")
    comma = [it for it in held if it["prompt"].endswith(", ") and "\n" not in it["target"]]
    assert 50 < len(comma) < 60                 # the rest: a second entry of the first counts
    for row, it in zip(rows["wedlm_demo_next"], comma):
        assert row == dict(prompt=it["prompt"], answer=it["target"].split(",")[0].strip())
    for row, it in zip(rows["wedlm_demo_next"][len(comma):], comma):     # one entry further on
        first, second = [e.strip() for e in it["target"].split(",")][:2]
        assert row == dict(prompt=f"{it['prompt']}{first}, ", answer=second)
    for nxt, ch in zip(rows["wedlm_demo_next"], rows["wedlm_demo_choice"]):
        assert ch["prompt"] == nxt["prompt"] and ch["choices"][ch["label"]] == nxt["answer"]
        n, end = q._count_entry(nxt["answer"])
        assert sorted(ch["choices"]) == sorted(f"{n + k}/{end}" for k in (0, -1, 1, 10))
    texts = [r["text"] for r in rows["wedlm_demo_documents"]]
    assert texts[0] == held[0]["prompt"] + held[0]["target"] and texts[-1].startswith("Q: ")
    assert sorted(os.listdir(tmp_path)) == ["data", *sorted(f"{t}.yaml" for t in q.TASK_FILES)]


@pytest.mark.parametrize("args, says", [
    (["--schemes", "none,int9"], "unknown scheme 'int9'"),
    (["--schemes", "int8"], "must include none"),
    (["--items", "0"], "--items 0"),
    (["--items", "-3"], "--items -3"),
    (["--items", "100000"], "at most"),
    (["--model", "/no/such/folder"], "/no/such/folder"),
])
def test_a_bad_argument_exits_2_before_any_server(args, says, capsys, started, tiny_demo_model):
    argv = (["--model", tiny_demo_model] if "--model" not in args else []) + args
    with pytest.raises(SystemExit) as e:
        q.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert started == []
