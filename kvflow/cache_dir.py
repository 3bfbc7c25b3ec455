"""Where kvflow keeps what it builds once per machine: converted models, native
kernels, device calibrations. `KVFLOW_CACHE_DIR` moves all of it."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")
