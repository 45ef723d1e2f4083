"""benchmarks.decoding.window_cost.measure, the per-forward cost beside every speed-up in BENCHMARKS.md.
(Tests of the measuring programs live here, beside them: tests/ does not import benchmarks.)"""

from __future__ import annotations

from benchmarks.synthetic import random_params
from wedlm_jax.config import ModelConfig

CONFIG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     mask_token_id=63)


def test_window_cost_measures_each_window_in_a_loop():
    """One positive time per W, and the forward it times is the engine's: a donated cache carried
    through the loop, so a wrong donation or a changed model signature fails here, not in a benchmark."""
    from benchmarks.decoding.window_cost import measure
    params = random_params(CONFIG, seed=0)
    times = measure(CONFIG, params, [1, 4], prefix=8, capacity=32, kv_tile=16, repeats=2, inner=3)
    assert sorted(times) == [1, 4]
    assert all(0.0 < t < 1.0 for t in times.values()), times


def test_the_table_of_a_train_configs_shape(capsys):
    """The program itself on the tiny train config's model: one time per W, W = 1 first."""
    from benchmarks.decoding.window_cost import main
    times = main(["--config", "configs/tiny_cpu.yaml", "--windows", "1,4", "--prefix", "8",
                  "--capacity", "64", "--kv-tile", "16", "--repeats", "2"])
    assert sorted(times) == [1, 4] and all(0.0 < t < 1.0 for t in times.values()), times
    lines = capsys.readouterr().out.splitlines()
    assert '"config": "configs/tiny_cpu.yaml"' in lines[0] and lines[1].split()[:2] == ["W", "median"]
    assert [line.split()[0] for line in lines[2:]] == ["1", "4"]
    assert lines[2].split()[2] == "1.00"                 # W = 1 against itself
