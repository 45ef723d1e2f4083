"""Power-of-two buckets: the one rounding of every size that is compiled in buckets (prompt
lengths, live slots, scoring batches, automaton tables, kernel blocks). No jax here."""


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two that is at least `n` and at least `floor`."""
    return max(floor, 1 << max(int(n) - 1, 0).bit_length())
