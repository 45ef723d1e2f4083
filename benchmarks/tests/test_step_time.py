"""benchmarks.decoding.step_time at toy size: milliseconds per decode step of the demo model, streaming and
AR, every slot live."""

from __future__ import annotations

import json

from benchmarks.decoding import step_time


def test_milliseconds_per_step_streaming_and_ar(capsys):
    out = step_time.main(["--slots", "2", "--chunks", "2", "--window", "4"])
    assert sorted(out) == ["ar", "streaming"]
    assert all(0 < ms < 10_000 for ms in out.values()), out
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
