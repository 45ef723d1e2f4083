"""Serving many LoRA adapters in one continuous batch, on the demo model (CPU, float32) with two
random PEFT adapters large enough to change its greedy output:

  the batched low-rank forward (an adapter table, a row per sequence) equals, row by row, the
  forward of that row's adapter merged into the weights (`lora.fold`);
  two adapters and the base decoded in one continuous batch each give their solo run's tokens
  (streaming, verified, AR), and verified streaming gives AR's under an adapter;
  the server lists the adapters, serves `model: NAME`, loads and unloads at run time, refuses
  unknown names (404) and bad adapters (400 naming them), and compiles nothing for a new adapter.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.engine.batcher import Batcher
from decode.engine.state import Request
from decode.lora_options import LoraOptions
from demo.eval import DEMO_MODEL, load_model
from tests import plans
from wedlm_jax import lora as lora_lib
from wedlm_jax import lora_table
from wedlm_jax.lora_spec import LoraSpec
from wedlm_jax.model import Transformer
from wedlm_jax.peft import save_peft

SPECS = {"alpha": LoraSpec(rank=4, alpha=8.0, targets=("all-linear",)),
         "beta": LoraSpec(rank=8, alpha=8.0, targets=("q", "v", "down"))}
SCALES = {"alpha": 0.1, "beta": 0.2}       # large enough to change the greedy tokens
LENGTHS = (24, 17, 20, 12)                   # the prompts' lengths (the demo's eval prompts, cut)


def random_adapter(config, spec, seed, scale):
    """An adapter tree of `spec`, A and B both random (scaled so the output changes)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (scale * rng.standard_normal(s.shape)).astype(np.float32),
                        lora_lib.adapter_shapes(config, spec))


@pytest.fixture(scope="module")
def demo():
    config, params, tokenizer = load_model(check=False)
    return config, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params), tokenizer


@pytest.fixture(scope="module")
def prompts(demo):
    with open(os.path.join(DEMO_MODEL, "eval.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][:len(LENGTHS)]
    return [tuple(demo[2].encode(t))[:n] for t, n in zip(texts, LENGTHS)]


@pytest.fixture(scope="module")
def adapters(demo, tmp_path_factory):
    """{name: (spec, adapter tree, PEFT folder)}."""
    config = demo[0]
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed, (name, spec) in enumerate(SPECS.items(), 1):
        tree = random_adapter(config, spec, seed, SCALES[name])
        out[name] = (spec, tree, save_peft(config, tree, spec, root / name, base=DEMO_MODEL))
    return out


def test_batched_forward_equals_each_rows_merged_weights(demo, adapters):
    config, params, _ = demo
    table = lora_table.empty_table(config, 3, 8)
    for row, name in ((1, "alpha"), (3, "beta")):
        spec, tree, _ = adapters[name]
        table = lora_table.write_row(table, row, lora_table.adapter_rows(config, tree, spec, 8))
    rng = np.random.default_rng(0)
    tokens, positions = rng.integers(0, 512, (3, 12)), np.tile(np.arange(12), (3, 1))
    model = Transformer(config)
    got = np.asarray(model.apply({"params": lora_table.attach(params, table)}, tokens, positions,
                                 lora_index=jnp.asarray([1, 0, 3], jnp.int32)))
    base = np.asarray(model.apply({"params": params}, tokens, positions))
    for i, name in ((0, "alpha"), (2, "beta")):
        spec, tree, _ = adapters[name]
        want = np.asarray(model.apply({"params": lora_lib.fold(params, tree, spec)}, tokens,
                                      positions))[i]
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4)
        assert np.abs(want - base[i]).max() > 0.5          # the adapter matters
    np.testing.assert_array_equal(got[1], base[1])         # row 0: the base, exactly


def _decoder(demo, method, **kw):
    config, params, _ = demo
    return plans.decoder(params, config, method=method, window=4, slots=4, capacity=64,
                         steps_per_call=3, sampling=False, kv_tile=16,
                         lora=LoraOptions(enable_lora=True, max_loras=2, max_lora_rank=8), **kw)


def _run(batcher, jobs):
    """Submit every (prompt, adapter name or None) at once; {index: generated ids}."""
    done, ids = {}, {}
    for i, (prompt, name) in enumerate(jobs):
        rid = batcher.submit(Request(prompt=prompt, max_new_tokens=12, stop_token_ids=()),
                             on_finish=lambda f: done.__setitem__(f.request_id, f.tokens),
                             adapter=name)
        ids[rid] = i
    batcher.run_until_idle()
    return {ids[k]: v for k, v in done.items()}


@pytest.mark.parametrize("method, page_size", [("streaming", 16), ("verified", 16), ("ar", 0)])
def test_adapters_and_base_in_one_batch_equal_solo(demo, adapters, prompts, method, page_size):
    dec = _decoder(demo, method, page_size=page_size)
    for name in SPECS:
        dec.adapters.load(name, adapters[name][2])
    jobs = [(prompts[0], "alpha"), (prompts[0], None), (prompts[0], "beta"),
            (prompts[1], "alpha"), (prompts[2], "beta"), (prompts[3], None)]
    together = _run(Batcher(dec), jobs)
    for i, job in enumerate(jobs):
        assert together[i] == _run(Batcher(dec), [job])[0], (method, job)
    outs = {tuple(together[i]) for i in range(3)}
    assert len(outs) == 3, outs                              # each adapter changes the output


def test_verified_equals_ar_under_an_adapter(demo, adapters, prompts):
    got = {}
    for method in ("verified", "ar"):
        dec = _decoder(demo, method)
        dec.adapters.load("beta", adapters["beta"][2])
        got[method] = _run(Batcher(dec), [(p, "beta") for p in prompts])
    assert got["verified"] == got["ar"]
