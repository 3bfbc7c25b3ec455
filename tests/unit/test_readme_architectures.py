"""README's table of supported architectures and the model registry name the same ones."""

from __future__ import annotations

import re
from pathlib import Path

from kvflow.gpu_worker.models.registry import MODEL_CLASSES

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| `([A-Z]\w+)` \|")  # a class name; not the header


def readme_architectures() -> list[str]:
    """The first cell of each row of the table under '### Supported architectures'."""
    section = README.read_text().split("### Supported architectures", 1)[1]
    section = section.split("\n#", 1)[0]
    return [m.group(1) for line in section.splitlines() if (m := ROW.match(line))]


def test_readme_table_lists_exactly_the_registry() -> None:
    names = readme_architectures()
    assert len(names) == len(set(names)), "one row per architecture"
    assert sorted(names) == sorted(MODEL_CLASSES)
