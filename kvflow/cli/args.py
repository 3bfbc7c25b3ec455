"""CLI flags generated from the engine config dataclasses (one source of truth)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal

from kvflow.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """`--block-size 16`, `--no-enable-prefix-caching`, ... from every config field."""
    group = parser.add_argument_group("engine")
    hints: dict[str, Any] = {}
    for section in _section_classes():
        hints.update(typing.get_type_hints(section))
        for f in dataclasses.fields(section):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            kind = hints[f.name]
            if kind is bool:
                group.add_argument(
                    flag,
                    dest=f.name,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=f"{help_text} (default: {f.default})",
                )
                continue
            choices = _literal_choices(kind)
            group.add_argument(
                flag,
                dest=f.name,
                type=f.metadata.get("parse") or _scalar_type(kind),
                choices=choices,
                nargs=f.metadata.get("nargs"),
                default=None,
                help=f"{help_text} (default: {f.default})",
            )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user actually set (None = keep the config default)."""
    names = [f.name for section in _section_classes() for f in dataclasses.fields(section)]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _section_classes() -> list[type]:
    hints = typing.get_type_hints(EngineConfig)
    return [hints[f.name] for f in dataclasses.fields(EngineConfig)]


def _literal_choices(kind: Any) -> list[Any] | None:
    if typing.get_origin(kind) is Literal:
        return list(typing.get_args(kind))
    return None


def _scalar_type(kind: Any) -> Any:
    if typing.get_origin(kind) is Literal:
        return type(typing.get_args(kind)[0])
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return _scalar_type(args[0])
    return kind
