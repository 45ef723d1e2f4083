"""lm-eval end to end: lm-eval's own CLI (`local-completions`, the remote tokenizer)
against a real `wedlm-serve` subprocess on 127.0.0.1 serving the shipped demo model, on the local
task set in tests/lm_eval_tasks/ (generate_until with exact match, multiple_choice,
loglikelihood_rolling; jsonl data in the tree). Every per-sample score lm-eval reports is computed
again here directly with the project's model (decode.serving.scoring for log-likelihoods, the Decoder for
generations), and the AR reading's log-probabilities are checked against transformers on the same
Hugging Face folder."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from decode.config import DecodeConfig  # noqa: E402
from decode.serving.scoring import score  # noqa: E402
from decode.static.static_batch import generate  # noqa: E402
from decode.text import stop_at_strings  # noqa: E402
from tests.live_server import start_subprocess_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "lm_eval_tasks")
DEMO = os.path.join(ROOT, "demo", "model")
WINDOW, SLOTS, CAPACITY, MAX_LENGTH = 8, 4, 512, 500
EOS = "<|endoftext|>"


def _samples(out_dir: str, task: str) -> list[dict]:
    files = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
    assert len(files) == 1, files
    rows = [json.loads(line) for line in open(files[0])]
    return sorted(rows, key=lambda r: r["doc_id"])


def _results(out_dir: str) -> dict:
    files = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    assert len(files) == 1, files
    return json.load(open(files[0]))["results"]


def _metric(results: dict, task: str, name: str) -> float:
    row = results[task]
    key = next(k for k in row if k.split(",")[0] == name)
    return float(row[key])


def _encode_pair(tok, context: str, continuation: str):
    """lm-eval's split of (context, continuation) into tokens: trailing whitespace of the context
    moves to the continuation; the continuation is what follows the context's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


@pytest.fixture(scope="module")
def lm_eval_run(tmp_path_factory):
    """The server and one lm-eval run over the three tasks; (output folder, lm-eval's stdout)."""
    out = tmp_path_factory.mktemp("lm_eval")
    proc, url = start_subprocess_server(
        DEMO, "--slots", str(SLOTS), "--window", str(WINDOW), "--capacity", str(CAPACITY),
        "--model-name", "demo", "--lazy-compile")   # the run's compile cache (tests/xla.py)
    try:
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(out / "hf"),
                   OPENAI_API_KEY="unused", TOKENIZERS_PARALLELISM="false")
        args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                f"model=demo,base_url={url}/v1/completions,tokenizer_backend=remote,"
                f"tokenized_requests=True,num_concurrent=2,max_retries=1,max_length={MAX_LENGTH}",
                "--tasks", "wedlm_demo_next,wedlm_demo_choice,wedlm_demo_documents",
                "--include_path", ".", "--output_path", str(out / "results"), "--log_samples"]
        run = subprocess.run(args, cwd=TASKS, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return str(out / "results"), run.stdout


@pytest.fixture(scope="module")
def demo():
    from demo.eval import load_model
    return load_model(DEMO)


def test_multiple_choice_equals_the_models_own_loglikelihoods(lm_eval_run, demo):
    out, _ = lm_eval_run
    config, params, tok = demo
    rows = _samples(out, "wedlm_demo_choice")
    docs = [json.loads(line) for line in open(os.path.join(TASKS, "data", "next_number_choice.jsonl"))]
    assert len(rows) == len(docs) == 16
    right = []
    for row, doc in zip(rows, docs):
        pairs = [_encode_pair(tok, doc["prompt"], c) for c in doc["choices"]]
        scored = score(params, config, [c + k for c, k in pairs])
        want = [sum(s["token_logprobs"][len(c):]) for s, (c, _) in zip(scored, pairs)]
        got = [float(r[0]) for r in row["filtered_resps"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
        right.append(int(np.argmax(want)) == doc["label"])
        assert row["acc"] == float(right[-1])
    assert _metric(_results(out), "wedlm_demo_choice", "acc") == pytest.approx(np.mean(right))
    assert np.mean(right) > 0.5     # the demo model knows which number comes next


def test_rolling_loglikelihood_equals_the_models_own(lm_eval_run, demo):
    out, _ = lm_eval_run
    config, params, tok = demo
    rows = _samples(out, "wedlm_demo_documents")
    docs = [json.loads(line)["text"] for line in open(os.path.join(TASKS, "data", "documents.jsonl"))]
    assert len(rows) == len(docs) == 8
    eot = tok.encode(EOS)
    assert len(eot) == 1
    total_ll, words = 0.0, 0
    for row, text in zip(rows, docs):
        want = sum(score(params, config, [eot + tok.encode(text)])[0]["token_logprobs"][1:])
        got = float(np.ravel(row["filtered_resps"])[0])
        assert got == pytest.approx(want, abs=1e-3)
        total_ll, words = total_ll + want, words + len(re.split(r"\s+", text))
    assert _metric(_results(out), "wedlm_demo_documents", "word_perplexity") == pytest.approx(
        math.exp(-total_ll / words), rel=1e-4)


def test_generate_until_equals_the_decoder_alone(lm_eval_run, demo):
    """lm-eval's generations through the server (streaming, W 8, greedy, stops at "," and eos)
    are the Decoder's on each prompt alone; exact match scored the same."""
    out, _ = lm_eval_run
    config, params, tok = demo
    rows = _samples(out, "wedlm_demo_next")
    docs = [json.loads(line) for line in open(os.path.join(TASKS, "data", "next_number.jsonl"))]
    assert len(rows) == len(docs) == 16
    stops = tuple(dict.fromkeys(tok.default_stop_ids(config.eos_token_id) + tok.encode(",")))
    dc = DecodeConfig(method="streaming", window=WINDOW, max_new_tokens=8, stop_token_ids=stops)
    right = []
    for row, doc in zip(rows, docs):
        ids = generate(params, config, [tok.encode(doc["prompt"])], dc, capacity=CAPACITY).tokens[0]
        _, text, _ = stop_at_strings(tok, list(ids), [",", EOS])
        assert row["filtered_resps"][0] == text
        right.append(text == doc["answer"])
        assert row["exact_match"] == float(right[-1])
    assert _metric(_results(out), "wedlm_demo_next", "exact_match") == pytest.approx(np.mean(right))


def test_ar_reading_equals_transformers_on_the_demo_folder(demo):
    """The log-probabilities lm-eval receives (decode.serving.scoring) equal transformers' on the same
    Hugging Face folder, float32, within 1e-4 per token."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config, params, tok = demo
    docs = [json.loads(line)["text"] for line in open(os.path.join(TASKS, "data", "documents.jsonl"))]
    seqs = [tok.encode(EOS) + tok.encode(t) for t in docs[:4]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO, torch_dtype=torch.float32).eval()
    ours = score(params, config, seqs)
    for seq, mine in zip(seqs, ours):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
        np.testing.assert_allclose(mine["token_logprobs"][1:], lp, atol=1e-4)
