"""Compatibility path: the demo's evaluation moved to `demo.eval` (issue 16); import from there."""
from demo.eval import *  # noqa: F401,F403
