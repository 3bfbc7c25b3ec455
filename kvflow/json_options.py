"""The JSON-object options of vLLM's shape (`--speculative-config`,
`--kv-transfer-config`): JSON text from the command line or a dict from `LLM(...)`,
checked against the dataclass that holds them."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvflow.errors import ConfigError


def json_options(
    value: str | dict[str, Any], cls: type, name: str, required: tuple[str, ...]
) -> dict[str, Any]:
    """The keys of `value` (JSON text or a dict), all fields of `cls`, the required ones
    present; a ConfigError naming `name` otherwise."""
    options = _json_object(value, name) if isinstance(value, str) else dict(value)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown {name} keys: {', '.join(unknown)}")
    for key in required:
        if key not in options:
            raise ConfigError(f"{name} needs {key!r}")
    return options


def _json_object(text: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object")
    return value
