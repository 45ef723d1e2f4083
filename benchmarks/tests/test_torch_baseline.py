"""The PyTorch peer's decode loop (benchmarks.gpu.torch_baseline) on a tiny random Qwen3 on this CPU:
its greedy tokens are transformers' own `generate`'s, and this project's AR decode of the same
weights gives them too: the peer and the JAX runs decode the same model."""

from __future__ import annotations

import torch

from benchmarks.gpu import torch_baseline as tb


def test_the_peers_tokens_are_transformers_and_ours(tmp_path):
    from decode.config import DecodeConfig
    from decode.static.static_batch import generate
    from wedlm_jax import convert
    cpu = torch.device("cpu")
    model = tb.build_model(tb.hf_config("smoke"), cpu, torch.float32)
    prompts = tb.random_prompts(model.config.vocab_size, 2, 24, 3, cpu)
    new = 10
    mine = tb.greedy_tokens(model, prompts, new)
    theirs = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                            do_sample=False)[:, prompts.shape[1]:].tolist()
    assert mine == theirs
    assert len({tuple(r) for r in mine}) == 2 and len(mine[0]) == new
    model.save_pretrained(tmp_path / "hf")
    config, params = convert.load_hf_checkpoint(tmp_path / "hf", progress=False)
    ours = generate(params, config, prompts.tolist(), DecodeConfig(method="ar", max_new_tokens=new))
    assert ours.tokens == mine


def test_the_peer_in_its_own_process_writes_its_report(tmp_path):
    got = tb.run_subprocess(str(tmp_path / "t.json"), 300, smoke=True, batches=(2,), steps=4,
                            rounds=2)
    assert got["returncode"] == 0 and got["stage"] == "done" and got["dtype"] == "float32"
    assert got["max_cache_len"] == 32 + (3 + 2) * 4                # live + every decoded token
    row = got["batches"]["2"]
    assert row["ms_per_step"] > 0 and len(row["ms_rounds"]) == 2 and row["prefill_s"] >= 0


def test_the_peer_is_stopped_at_its_time_limit(tmp_path):
    got = tb.run_subprocess(str(tmp_path / "t.json"), 1, smoke=True, batches=(1,), steps=4,
                            rounds=2)
    assert got["stopped"] == "time limit 1 s" and "returncode" not in got
