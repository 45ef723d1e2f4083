"""benchmarks.training.convert at toy size: a generated Qwen3-shaped checkpoint through wedlm-convert both
ways and to bf16, each in its own measured process; the round trip gives the same tensors."""

from __future__ import annotations

from benchmarks.training import convert
from wedlm_jax.config import ModelConfig


def test_generated_checkpoint_round_trip_measured(tmp_path, capsys):
    r = convert.main(["--layers", "1", "--hidden", "128", "--vocab", "256", "--workdir",
                      str(tmp_path)])
    config = ModelConfig.from_hf_dict(convert.qwen3_config(1, 128, 256))
    # embeddings and head, q/o (2 heads of 128) and k/v (1 head), the MLP, 5 norms of 128
    assert config.num_params() == 2 * 256 * 128 + 3 * 128 * 256 + 3 * 128 * 352 + 5 * 128
    assert r["checkpoint_bytes"] == 4 * config.num_params()         # f32, every tensor once
    assert r["hf_round_trip_bytes"] > r["checkpoint_bytes"]         # + index, config
    assert r["orbax_bf16_bytes"] < r["orbax_bytes"]                 # half the weights' bytes
    assert set(r["runs"]) == {"hf-to-orbax", "orbax-to-hf", "hf-to-orbax --dtype bf16"}
    for run in r["runs"].values():
        assert run["wall_s"] > 0 and run["peak_rss"] > r["baseline_rss"] / 2
    assert r["target_rss"] == 1.3 * r["checkpoint_bytes"] + r["baseline_rss"]
    assert "round trip HF -> Orbax -> HF: all tensors equal" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []                           # the work folder removed
