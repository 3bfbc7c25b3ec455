"""Size rules for the project's code: no file over 400 lines, no function over 60.

Project code is every Python file under kvflow/, proto/, services/, gpu_worker/ and
kernels/, plus docker/healthcheck.py; tests are not. A function is measured from its
`def` line to its last line (decorators excluded); a nested function counts within its
parent, and methods are measured like any other function.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
PROJECT_DIRS = ("kvflow", "proto", "services", "gpu_worker", "kernels")
PROJECT_FILES = ("docker/healthcheck.py",)
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


class FunctionSize(NamedTuple):
    name: str  # qualified within the module: "Class.method", "outer.inner"
    line: int  # the `def` line
    length: int  # lines from the `def` line to the last line, both included


def function_sizes(source: str) -> list[FunctionSize]:
    """Every function and method in `source`, nested ones included, with its length."""
    sizes: list[FunctionSize] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                end = child.end_lineno if child.end_lineno is not None else child.lineno
                name = prefix + child.name
                sizes.append(FunctionSize(name, child.lineno, end - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sizes


def project_files() -> list[Path]:
    files = [p for d in PROJECT_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return files + [ROOT / f for f in PROJECT_FILES]


def test_function_sizes_measures_from_def_to_last_line() -> None:
    source = (
        "import functools\n"  # 1
        "\n"  # 2
        "@functools.cache\n"  # 3: a decorator is not counted
        "def top(x):\n"  # 4
        "    def inner():\n"  # 5
        "        return x\n"  # 6
        "    return inner\n"  # 7
        "\n"  # 8
        "class C:\n"  # 9
        "    async def method(self):\n"  # 10
        '        """Doc."""\n'  # 11
        "\n"  # 12
        "        return (\n"  # 13
        "            1\n"  # 14
        "        )\n"  # 15
    )
    assert function_sizes(source) == [
        FunctionSize("top", 4, 4),
        FunctionSize("top.inner", 5, 2),
        FunctionSize("C.method", 10, 6),
    ]


def test_project_files_exist() -> None:
    # An empty walk (a renamed folder) would make both rules pass vacuously.
    files = project_files()
    assert len(files) > 50
    assert all(p.is_file() for p in files)


def test_no_file_over_400_lines() -> None:
    too_long = []
    for path in project_files():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not too_long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(too_long)


def test_no_function_over_60_lines() -> None:
    too_long = []
    for path in project_files():
        for f in function_sizes(path.read_text(encoding="utf-8")):
            if f.length > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(ROOT)}:{f.line} {f.name}: {f.length} lines")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)
