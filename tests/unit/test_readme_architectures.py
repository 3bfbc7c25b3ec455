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


def test_readme_gguf_column_is_the_converters_table() -> None:
    """The GGUF column names, for each class, the llama.cpp architectures that convert to it
    (gpu_worker/gguf_archs.py; Mixtral is `llama` with experts)."""
    from kvflow.gpu_worker.gguf_archs import ARCHS, VARIANTS

    section = README.read_text().split("### Supported architectures", 1)[1].split("\n#", 1)[0]
    column: dict[str, str] = {}
    for line in section.splitlines():
        if ROW.match(line):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            column[cells[0].strip("`")] = cells[3]
    expected: dict[str, list[str]] = {}
    for name, arch in ARCHS.items():
        expected.setdefault(arch.hf_class, []).append(f"`{name}`")
    for variant in VARIANTS:
        expected.setdefault(variant.row.hf_class, []).append(f"`{variant.arch}` {variant.when}")
    listed = {cls: cell for cls, cell in column.items() if cell != "—"}
    assert listed == {cls: ", ".join(names) for cls, names in expected.items()}
