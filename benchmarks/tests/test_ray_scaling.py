"""benchmarks/doors/ray_scaling.py's arithmetic (the jobs themselves run in tests/ray_in_namespace.py): the
driver's cost fitted from jobs of known cost, and the number of hosts it can feed."""

import pytest

from benchmarks.doors.ray_scaling import driver_cost, median_run, scaling_bound


def job(wall, blocks, idle=0.02, per_block=0.005, tokens_per_s=100.0):
    cpu = idle * wall + per_block * blocks
    return dict(replicas=2, cpus_each=1, block_size=8, wall_s=wall, blocks=blocks,
                driver_s_per_block=cpu / blocks, tokens_per_s=tokens_per_s,
                decode_tokens_per_s=tokens_per_s)


def test_the_fit_recovers_the_driver_cost_and_the_bound_follows():
    runs = [job(40, 8), job(50, 8), job(60, 64), job(30, 32)]
    idle, per_block = driver_cost(runs)
    assert idle == pytest.approx(0.02) and per_block == pytest.approx(0.005)
    b = scaling_bound(runs, job(40, 8, tokens_per_s=128.0), block_size=8, max_tokens=32)
    assert b["host_blocks_per_s"] == pytest.approx(0.5)              # 128 tok/s over 256-token blocks
    assert b["driver_blocks_per_s"] == pytest.approx(0.98 / 0.005)
    assert b["hosts_before_the_driver_binds"] == pytest.approx(0.98 / 0.005 / 0.5)


def test_median_of_rounds():
    m = median_run([job(40, 8, tokens_per_s=10.0), job(40, 8, tokens_per_s=30.0),
                    job(40, 8, tokens_per_s=20.0)])
    assert m["tokens_per_s"] == 20.0 and m["rounds"] == 3
