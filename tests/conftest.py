"""Fixtures several test modules share, found by pytest without an import. The constants and
helpers around them live in named modules beside this file (tests/decode_cases.py,
tests/batch_lines.py, tests/serve_cases.py, tests/quantize_cases.py). A module that needs another
model under the same name (`params`, `ckpt`, `server`) defines its own fixture, which overrides
the one here for that module.

Session scope where the result is never changed by a test (random weights, a checkpoint folder
that is only read, the demo model's weights and prompts); module scope for the server, whose
state the tests drive."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def params():
    """The decoding tests' random model (tests/decode_cases.py CONFIG) with its LM head x30: peaky
    logits, entropies over [0, log 64]."""
    from tests.decode_cases import CONFIG
    from tests.synthetic import random_params
    return random_params(CONFIG, 0, head_scale=30.0)


@pytest.fixture(scope="session")
def demo_prompts():
    """(config, params, prompts) of the demo model and a held-out prompt of five regimes, the
    quantized weights' and caches' comparisons with the float ones (tests/quantize_cases.py)."""
    from demo.eval import DEMO_MODEL, eval_items, load_model
    config, params, tok = load_model(check=False)
    prompts = [tok.encode(eval_items(DEMO_MODEL, k, 2)[1]["prompt"])
               for k in ("counting", "arith", "lists", "records", "code")]
    return config, params, prompts


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """(folder path, config, params) of the tiny checkpoint with its tokenizer files
    (tests/tiny_checkpoint.py) that the doors' tests (batch job, server, CLI, scoring, bad input)
    decode with; they only read it."""
    from tests.tiny_checkpoint import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture(scope="module")
def server(ckpt):
    """The app on 127.0.0.1 (uvicorn in a thread) over `ckpt`, its Batcher behind a Gate
    (tests/serve_cases.py): dict(url, gate, engine, tokenizer, config, params, client: the
    official `openai` client). Module scope: tests open, close and slow the gate."""
    import openai

    from decode.serving import serve
    from decode.engine.runtime.batcher import Batcher
    from tests.live_server import serve_in_thread
    from tests.serve_cases import CAPACITY, SLOTS, WINDOW, Gate
    path, config, params = ckpt
    args = serve._parser().parse_args(["--checkpoint", path, "--slots", str(SLOTS), "--window", str(WINDOW),
                                       "--capacity", str(CAPACITY), "--max-queue", "64",
                                       "--no-default-stops", "--model-name", "tiny"])
    decoder, tokenizer, cfg = serve.load_decoder(args)
    gate = Gate(Batcher(decoder))
    gate.inner.warm_up(CAPACITY, every_bucket=False)
    engine = serve.EngineThread(gate, max_pending=SLOTS + 64, scorer=serve.scorer_for(decoder)).start()
    app = serve.build_app(engine, tokenizer, cfg)
    url, srv, thread, sock = serve_in_thread(app)
    yield dict(url=url, gate=gate, engine=engine, tokenizer=tokenizer, config=config, params=params,
               client=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60))
    gate.open()
    srv.should_exit = True
    thread.join(15)
    engine.shutdown(timeout=15)
    sock.close()


# The suite's longest modules (tens of seconds each on a 2-core machine), scheduled first: under
# `pytest -n 2` a long test left to the end keeps one worker busy while the other waits.
LONG_FIRST = ("tests/test_ray_job.py", "benchmarks/tests/test_serve_defaults.py",
              "tests/test_demo_pipeline.py", "tests/test_decode_sharding.py",
              "benchmarks/tests/test_quantize_lm_eval.py", "tests/test_lm_eval.py",
              "tests/test_demo_model.py", "benchmarks/tests/test_paged.py",
              "benchmarks/tests/test_verified.py", "benchmarks/tests/test_serve.py")


def pytest_collection_modifyitems(session, config, items):
    """Every test of the LONG_FIRST modules first, in that order; the rest as collected."""
    rank = {module: i for i, module in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FIRST)))
