"""benchmarks.compiled.auto_layout: one layer of the 8B compiled for a v5p (libtpu, no TPU) with the
weights in the compiler's layouts against the default ones; `--compiler-option KEY=VALUE` values
read as train overrides are, "default" handing the option back to libtpu (None over the Decoder's
step options)."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from benchmarks.compiled.auto_layout import option
from decode.engine.planning import layouts
from tests import tpu_compiler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_compilers_layouts_move_fewer_bytes_than_the_default_ones(tmp_path):
    """The default row-major weights make XLA copy them into its tile order inside the step; in
    the compiler's layouts the AR step of one 8B layer moves about its floor."""
    out = tmp_path / "al.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compiled.auto_layout", "--layers", "1",
                           "--methods", "ar", "--out", str(out)], env=tpu_compiler.env(),
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    default, auto = rows["default"], rows["auto"]
    assert default["method"] == auto["method"] == "ar" and default["floor"] == auto["floor"] > 0
    assert 0.9 < auto["bytes_over_floor"] < 1.1 < default["bytes_over_floor"], rows
    assert 0 < auto["optimal_ms"] < default["optimal_ms"], rows


def test_compiler_options_parse_and_default_drops_the_decoders_own():
    assert option("xla_tpu_scoped_vmem_limit_kib=65536") == ("xla_tpu_scoped_vmem_limit_kib", 65536)
    assert option("xla_tpu_enable_x=false") == ("xla_tpu_enable_x", False)
    key, value = option("xla_tpu_scoped_vmem_limit_kib=default")
    assert value is None

    class V5p:
        platform, device_kind = "tpu", "TPU v5"
    assert layouts.step_options(V5p(), {key: value}) is None
    for bad in ("novalue", "=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
            option(bad)
