"""The package's metadata as setuptools reads it for `pip install -e .` (and so `make demo`):
no deprecation banner (the license an SPDX string), and a build requirement that reads it."""

from __future__ import annotations

import os
import re
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(ROOT, "pyproject.toml")


def test_pyproject_reads_without_a_deprecation_warning():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), PYPROJECT)
    assert not [str(w.message).splitlines()[0] for w in caught
                if issubclass(w.category, DeprecationWarning)]
    assert dist.metadata.license_expression == "Apache-2.0"


def test_build_requires_a_setuptools_that_takes_an_spdx_license():
    with open(PYPROJECT, encoding="utf-8") as f:
        text = f.read()
    assert re.search(r'^license = "Apache-2.0"', text, re.M)
    need = re.search(r'^requires = \[.*"setuptools>=(\d+)', text, re.M)
    assert need and int(need.group(1)) >= 77           # setuptools reads an SPDX license from 77
