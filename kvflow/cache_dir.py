"""Where kvflow keeps what it builds once per machine: converted models, native
kernels, device calibrations. `KVFLOW_CACHE_DIR` moves all of it."""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")


def cpu_model() -> str:
    """The CPU's model name: calibrations made on one machine are reused on its twins."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object cache file; {} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """Several processes may write at once: each renames its own file, the last wins."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(data, indent=1, sort_keys=True))
        partial.replace(path)
    except OSError as exc:
        logger.warning("could not write the cache file %s: %s", path, exc)
