"""The stop probes' data (benchmarks/demo_stop_probes.py): the loss lands where each says."""

import os

import numpy as np
import pytest

from benchmarks import demo_stop_probes as probes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_decision_flags_mark_the_separators_and_the_end_after_each_header_only():
    # two packed documents: "H : \n 1 2 , 3 4 EOS" and "H , : \n 5 \n 3 EOS", then padding
    H, COLON, NL, COMMA, EOS = 9, 8, 7, 6, 0
    tokens = np.array([[H, COLON, NL, 1, 2, COMMA, 3, 4, EOS, H, COMMA, COLON, NL, 5, NL, 3, EOS, 0]])
    seg = np.array([[1] * 9 + [2] * 8 + [0]])
    flags = probes.decision_flags(tokens, seg, header_end=COLON, newline=NL,
                                  decisions=(COMMA, NL, EOS))
    want = np.zeros_like(flags)
    want[0, [5, 8, 14, 16]] = True          # the header's comma and newline are not decisions
    np.testing.assert_array_equal(flags, want)


def test_a_tail_record_puts_the_last_numbers_in_the_response():
    r = probes.tail_record("Count by 2 from 1 to 9:\n", ["1", "3", "5", "7", "9"], ", ", 2)
    assert r == {"prompt": "Count by 2 from 1 to 9:\n1, 3, 5, ", "response": "7, 9"}


def test_the_probe_counts_skip_held_out_headers_and_are_reproducible():
    first = [p for p, _ in probes.counts(5, set())]
    again = [p for p, _ in probes.counts(5, set())]
    assert first == again
    skip = {first[0][0].split("\n", 1)[0]}
    assert [p for p, _ in probes.counts(4, skip)] == first[1:]


def test_an_existing_folder_is_refused(tmp_path):
    assert probes.main(["tail", str(tmp_path)]) == 2


@pytest.mark.parametrize("kind", ["tail"])
def test_the_tail_probe_writes_data_and_a_config(tmp_path, kind):
    out = tmp_path / "probe"
    assert probes.main([kind, str(out), "--model", os.path.join(ROOT, "demo", "model")]) == 0
    import yaml
    cfg = yaml.safe_load(open(out / "config.yaml"))
    assert cfg["steps"] == 150 and cfg["objective"]["kind"] == "dual_stream"
    lines = open(out / "data" / "train.jsonl").read().splitlines()
    assert len(lines) == 8500 and sum('"response"' in x for x in lines) == 6000
