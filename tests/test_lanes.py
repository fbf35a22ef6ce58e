"""Every entry of tests/lanes.py names a test (or a case) that exists, so a renamed test cannot
drop out of both `make test` and `make test-long`, and the quick loop's list stays true."""

import ast

import pytest
from conftest import COLLECTED, ROOT
from lanes import LONG, QUICK_OUT


def test_every_lane_entry_names_a_test():
    missing = []
    for entry in LONG + QUICK_OUT:
        file, name = entry.split("::")
        tree = ast.parse((ROOT / "tests" / file).read_text())
        if name.split("[")[0] not in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}:
            missing.append(entry)
    assert missing == [], "rename or drop these entries of tests/lanes.py"


def test_every_case_taken_out_of_the_quick_loop_exists():
    """A case id (`name[id]`) that no longer exists would leave the quick loop without a word."""
    cases = [e for e in QUICK_OUT if "[" in e]
    if not {e.split("::")[0] for e in cases} <= {c.split("::")[0] for c in COLLECTED}:
        pytest.skip("their files were not collected (run it with the whole suite, as make test does)")
    assert sorted(set(cases) - COLLECTED) == []
