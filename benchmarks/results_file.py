"""Where a benchmark's figures go: `write(path, figures)` writes them as indented JSON when a path
was given, and returns them."""

from __future__ import annotations

import json


def write(path: str | None, figures):
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
    return figures
