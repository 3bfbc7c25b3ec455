"""Every `kvflow` command and subcommand renders its --help (argparse formats help lazily,
so a stray `%` in a help string only fails when a user asks for help)."""

from __future__ import annotations

import argparse

import pytest

from kvflow.cli.main import build_parser


def _all_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _all_parsers(child, (*path, name))


def test_every_command_formats_its_help() -> None:
    parsers = list(_all_parsers(build_parser()))
    names = {" ".join(path) for path, _ in parsers}
    assert {"serve", "bench", "bench kernels", "bench throughput"} <= names
    for path, parser in parsers:
        text = parser.format_help()
        assert text.startswith("usage: kvflow"), path


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "kernels" in capsys.readouterr().out
