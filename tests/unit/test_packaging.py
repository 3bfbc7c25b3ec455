"""Every package folder is in pyproject's package list: an editable install finds a
missing one anyway, but the wheel the images install would not have it."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).parents[2]


def test_every_package_folder_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((name, *relative)))
    assert found == set(setuptools["packages"])
