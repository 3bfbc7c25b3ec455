"""LoRA serving options: how many adapters a step mixes, their largest rank, the host
cache, and the adapters a server starts with.

    kvflow serve --enable-lora --max-loras 4 --max-lora-rank 16 \
        --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/adapters/chat"}'
    LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)

`max_loras` adapters fit one step (the worker's preallocated slots); `max_cpu_loras`
loaded adapters stay in host memory (an LRU, at least `max_loras`). Adapters may be
loaded and unloaded at run time only with `allow_runtime_lora_updates` or the variable
KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=true (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), and
only from inside `lora_root` when it is set.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError, LoRAAdapterError
from kvflow.json_options import json_options

RUNTIME_UPDATES_ENV = "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path`, or JSON with `base_model_name`."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str | dict[str, Any] | LoRAModule) -> LoRAModule:
    if isinstance(value, LoRAModule):
        return value
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules takes name=path or JSON, got {value!r}")
        return LoRAModule(name, path)
    options = json_options(value, LoRAModule, "--lora-modules", ("name", "path"))
    return LoRAModule(**options)


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = _opt(False, "serve LoRA adapters on top of the base model")
    max_loras: int = _opt(1, "distinct LoRA adapters in one step (the worker's slots)")
    max_lora_rank: int = _opt(16, "largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = _opt(
        None, "loaded LoRA adapters kept in host memory (LRU; default: max_loras)"
    )
    lora_modules: tuple[LoRAModule, ...] = _opt(
        (), "adapters served from the start: name=path or JSON", nargs="+",
        parse=parse_lora_module,
    )  # fmt: skip
    lora_root: str | None = _opt(None, "adapters may only be loaded from inside this directory")
    allow_runtime_lora_updates: bool = _opt(
        False,
        f"enable /v1/load_lora_adapter and /v1/unload_lora_adapter (or {RUNTIME_UPDATES_ENV}=true)",
    )

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-modules names a adapter twice: {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def runtime_updates_allowed(self) -> bool:
        env = os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower()
        return self.allow_runtime_lora_updates or env in ("1", "true")

    def check_path(self, path: str) -> Path:
        """The adapter directory, resolved; a path outside `lora_root` is refused."""
        resolved = Path(path).expanduser().resolve()
        if self.lora_root is not None:
            root = Path(self.lora_root).expanduser().resolve()
            if not resolved.is_relative_to(root):
                raise LoRAAdapterError(f"LoRA path {path!r} is outside --lora-root")
        return resolved


def stable_lora_id(name: str, path: str) -> int:
    """The int id a served adapter gets: derived from its name and path, so every
    frontend process (and every restart) gives the same adapter the same id, and the
    prefix cache never mixes two adapters under one id."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return int.from_bytes(digest[:7], "little") + 1  # > 0, fits msgpack's int64
