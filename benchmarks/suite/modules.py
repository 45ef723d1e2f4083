"""Where the test suite's minutes go: the seconds of each test module (setup, call and teardown
of its tests, summed over the workers) and the slowest tests, from a JUnit XML report.

    .venv/bin/python -m pytest -q -n 2 --junitxml=/tmp/suite.xml tests benchmarks/tests
    python -m benchmarks.suite.modules /tmp/suite.xml [--top 25] [--json FILE]

With `-n 2` the module seconds add up to about twice the wall time (two workers)."""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET


def module_of(case) -> str:
    """tests/test_x.py from a testcase's classname (tests.test_x, or tests.test_x.TestClass)."""
    parts = case.get("classname", "").split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py" if parts else case.get("file", "?")


def read(path: str) -> tuple[dict, list]:
    """({module: [seconds, tests]}, [(seconds, test id)]) of the report at `path`."""
    modules: dict = collections.defaultdict(lambda: [0.0, 0])
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        seconds = float(case.get("time", 0) or 0)
        module = module_of(case)
        modules[module][0] += seconds
        modules[module][1] += 1
        tests.append((seconds, f"{module}::{case.get('name')}"))
    return dict(modules), sorted(tests, reverse=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a JUnit XML report (pytest --junitxml=FILE)")
    p.add_argument("--top", type=int, default=25, help="modules and tests to list")
    p.add_argument("--json", help="also write {modules, tests} to this file")
    args = p.parse_args(argv)
    try:
        modules, tests = read(args.report)
    except (OSError, ET.ParseError) as e:
        print(f"modules: {args.report}: cannot read it as a JUnit XML report ({e})", file=sys.stderr)
        return 2
    total = sum(s for s, _ in modules.values())
    print(f"{len(tests)} tests in {len(modules)} modules, {total:.0f} s summed over the workers")
    print("| module | tests | s |\n|---|---|---|")
    for name, (s, n) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {name} | {n} | {s:.0f} |")
    print("\nslowest tests (setup + call + teardown):")
    for s, name in tests[:args.top]:
        print(f"{s:8.1f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"modules": modules, "tests": tests}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
