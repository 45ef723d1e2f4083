"""The decoding plan (decode/engine/planning/plan.py): every static decision made and checked once, before any
weight is placed; the Decoder built from (params, plan) and its ahead-of-time surface."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.config import DecodeConfigError, EngineOptions, Placement, mask_id_for
from decode.engine.runtime.decoder import Decoder
from decode.engine.step.state import Request
from decode.engine.planning.plan import make_plan
from tests.synthetic import random_params
from wedlm_jax.config import ModelConfig
from wedlm_jax.model import unstack_layers

CONFIG = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                     mask_token_id=127)


def engine(**kw):
    return EngineOptions(**dict(dict(method="streaming", window=4, slots=2, capacity=64,
                                     steps_per_call=4), **kw))


def test_a_plan_holds_every_static_decision():
    plan = make_plan(CONFIG, engine(), Placement(dtype="bf16", kv_tile=32))
    st = plan.static
    assert (plan.method, plan.window, plan.slots, plan.capacity) == ("streaming", 4, 2, 64)
    assert plan.mask_id == 127 and not plan.paged and st.page_size == 0     # CPU: the dense cache
    assert st.dtype == "bfloat16" and st.kv_tile == 32 and st.rows % 64 == 0
    assert st.rows >= 64 + st.span and st.config.mask_token_id is None   # ids are runtime values
    assert plan.weight_layout == "default" and plan.memory_estimate["cache"] > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mask_id = 3
    paged = make_plan(CONFIG, engine(), Placement(page_size=16))
    assert paged.paged and paged.static.num_pages == 2 * -(-paged.static.rows // 16)
    assert make_plan(CONFIG, engine(method="ar")).window == 1
    # a continuous-batching door on CPU (the server, the batch job): pages of 16, so a lone
    # request steps only its live-slot bucket and shared prefixes are reused; unless asked
    door = make_plan(CONFIG, engine(slots=4), Placement(), continuous=True)
    assert door.paged and door.static.page_size == 16
    assert Decoder(random_params(CONFIG), door).live_buckets() == [1, 2]
    assert not make_plan(CONFIG, engine(), Placement(page_size=0), continuous=True).paged
    assert plan.replace(scan_unroll=2).static.scan_unroll == 2 and plan.static.scan_unroll == 1


@pytest.mark.parametrize("bad, match", [
    (dict(engine=dict(capacity=None)), "capacity must be given"),
    (dict(engine=dict(window=128)), "window 128 is larger than the capacity 64"),
    (dict(engine=dict(capacity=1024)), "exceeds the model's max_position_embeddings 512"),
    (dict(mask_token_id=128), r"mask_token_id 128 is outside the vocabulary \[0, 128\)"),
    (dict(top_logprobs=99), "top_logprobs must be an int"),
    (dict(memory_limit_bytes=1000), "decoding needs ~.* more than the 0.00 GiB available"),
    (dict(placement=dict(page_size=16, num_pages=0)), r"num_pages must be an int in \[1, "),
    (dict(placement=dict(attention="flash")), "attention 'flash' is unknown; allowed: auto, tiled"),
])
def test_a_setting_that_cannot_work_is_named(bad, match):
    with pytest.raises(DecodeConfigError, match=match):
        make_plan(CONFIG, engine(**bad.pop("engine", {})), Placement(**bad.pop("placement", {})), **bad)


def test_one_mask_id_rule():
    no_mask = CONFIG.replace(mask_token_id=None)
    assert mask_id_for(CONFIG, None, "streaming") == 127 and mask_id_for(CONFIG, 5, "block") == 5
    assert mask_id_for(no_mask, None, "ar") == 0           # never read by AR
    with pytest.raises(DecodeConfigError, match="needs a mask token id"):
        mask_id_for(no_mask, None, "streaming")
    with pytest.raises(DecodeConfigError, match="outside the vocabulary"):
        mask_id_for(CONFIG, -1, "verified")


def test_the_decoder_takes_a_plan_whole():
    params = random_params(CONFIG, seed=0)
    with pytest.raises(DecodeConfigError, match=r"takes \(params, plan\)"):
        Decoder(params, CONFIG)
    per_layer = unstack_layers(params, CONFIG.num_layers)
    with pytest.raises(DecodeConfigError, match="stacked_params=False"):
        Decoder(per_layer, make_plan(CONFIG, engine()))
    dec = Decoder(params, make_plan(CONFIG, engine()))
    assert dec.plan.static is dec.static and dec.slots == 2 and dec.mask_id == 127


def test_ahead_of_time_surface_compiles_the_programs_that_run():
    """`compile("generate")` from abstract arguments gives the program `generate` runs: the same
    tokens on the same state; "prefill" and the paged "admit" compile from shapes alone."""
    params = random_params(CONFIG, seed=1)
    dec = Decoder(params, make_plan(CONFIG, engine(), sampling=False))
    prompt = Request(prompt=(3, 9, 27, 81), max_new_tokens=12)
    fresh = lambda: dec.insert(dec.prefill(prompt), dec.init_state(), 0)
    _, want = dec.generate(fresh())
    compiled = dec.compile("generate")
    _, toks, _, counts, steps = compiled(dec.params, fresh(), jnp.int32(dec.mask_id),
                                         jnp.int32(dec.steps_per_call))
    assert int(steps) == want.steps
    np.testing.assert_array_equal(np.asarray(toks)[0], want.tokens[0])
    np.testing.assert_array_equal(np.asarray(counts)[0], want.counts[0])
    args = dec.abstract_args("prefill", prompt_len=32)
    assert args[1].shape == (1, 32) and all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args[0]))
    assert dec.compile("prefill", prompt_len=32).memory_analysis() is not None
    with pytest.raises(DecodeConfigError, match="paged cache"):
        dec.lower("admit", prompt_len=32)
    paged = Decoder(params, make_plan(CONFIG, engine(), Placement(page_size=16), sampling=False))
    assert paged.compile("admit", prompt_len=32).memory_analysis() is not None
    with pytest.raises(DecodeConfigError, match="program must be one of generate, prefill, admit"):
        dec.abstract_args("decode")
