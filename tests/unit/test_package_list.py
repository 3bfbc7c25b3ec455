"""Every folder of Python code ships: pyproject's explicit package list (needed for the
package-dir mapping proto/ -> kvflow.proto, ...) names each one, and nothing else. A
folder missing from the list works in an editable install and breaks the wheel, the
Docker images and `make lint`'s installed tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _folders_with_code() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = pyproject["tool"]["setuptools"]["package-dir"]
    found = set()
    for name, folder in mapping.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            relative = path.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *relative.parts]))
    return found


def test_the_package_list_names_every_folder_of_code() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = _folders_with_code()
    assert "kvflow.services.launch" in found and "kvflow.proto" in found
    assert sorted(found - listed) == [], "folders of code missing from pyproject's packages"
    assert sorted(listed - found) == [], "packages listed without a folder of code"
