"""`ruff check` (pyproject.toml's [tool.ruff]) finds nothing in the project's code."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("wedlm_jax", "decode", "train", "demo", "benchmarks", "tests", "conftest.py")


def ruff() -> list[str]:
    """The ruff beside this interpreter (the test extra installs it), else the one on PATH."""
    here = pathlib.Path(sys.executable).with_name("ruff")
    found = str(here) if here.exists() else shutil.which("ruff")
    assert found, "ruff is missing: pip install -e '.[test]'"
    return [found]


def test_ruff_finds_nothing():
    out = subprocess.run(ruff() + ["check", "--no-cache", *FOLDERS], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
