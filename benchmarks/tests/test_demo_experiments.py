"""The accuracy experiment's "right through the end value" count (issue 20: the stop at b)."""

from benchmarks.demo_experiments import through_end


def test_through_end_counts_right_numbers_whether_or_not_the_count_stops():
    target = "89, 94, 99, 104"
    assert through_end(target, "89, 94, 99, 104")                 # exact
    assert through_end(target, "89, 94, 99, 104, 109, 114")       # right, runs past b
    assert not through_end(target, "89, 94, 99, 1045")            # a longer last number
    assert not through_end(target, "89, 94, 99")                  # stopped early
    assert not through_end(target, "89, 95, 99, 104")             # a wrong number
    assert through_end("a\nb", " a\nb\n")                          # one per line, spaces stripped
