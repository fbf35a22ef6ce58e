"""Every entry of the long lane (tests/lanes.py) names a test that exists, so a renamed test
cannot drop out of both `make test` and `make test-long`."""

import ast

from conftest import ROOT
from lanes import LONG


def test_every_long_lane_entry_names_a_test():
    missing = []
    for entry in LONG:
        file, name = entry.split("::")
        tree = ast.parse((ROOT / "tests" / file).read_text())
        if name not in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}:
            missing.append(entry)
    assert missing == [], "rename or drop these entries of tests/lanes.py"
