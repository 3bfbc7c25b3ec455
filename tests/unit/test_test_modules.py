"""Test modules have unique basenames: tests/ has no packages, so pytest imports each
module by its basename, and a second `test_x.py` anywhere under tests/ breaks the whole
suite's collection ("import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_basename_is_unique() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
