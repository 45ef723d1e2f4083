"""Ahead-of-time compiles without the hardware: the dry runs (aot.py) and the step cost
(cost.py)."""
