"""benchmarks.auto_layout's `--compiler-option KEY=VALUE`: values read as train overrides are,
"default" handing the option back to libtpu (None over the Decoder's step options)."""

import argparse

import pytest

from benchmarks.auto_layout import option
from decode import layouts


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
