"""Start-up phases: how long each step of bringing a server up took, by name.

Each process times its own phases and the scheduler gathers them into its stats, from
where the frontend exports `kvflow:startup_phase_seconds{phase=...}` and `kvflow bench
startup` reads them. Phase names in use (seconds each; a phase that did not run is absent):

    launcher_process_start  launcher: interpreter start and the CLI's imports
    frontend_import         launcher: import the frontend (before any child starts)
    model_resolve           launcher: find the model; convert a GGUF on the first start
    worker_process_start    worker: interpreter start, spawn and kvflow imports
    worker_torch_import     worker: import torch and the model code
    tokenizer_load          worker: EOS ids from the tokenizer files
    native_kernels          worker on CPU: build the native CPU kernels (cached: ~free)
    model_load              worker: build the model and load its weights
    roofline_calibration    worker: the device's peaks (a cached calibration is ~free)
    kv_cache_profile        worker: how many KV blocks fit
    kv_cache_allocate       worker: allocate the KV cache tensors
    cuda_graph_capture      worker: capture decode CUDA graphs (0 on CPU / --enforce-eager)

These run one after another: the launcher's, then (from the spawn) the worker's, so
their sum is when the engine can start; what is left of the time to ready is the
scheduler's and the frontend's start-up after that, which overlap with the worker's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupPhases:
    """Seconds per phase, in the order the phases ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def measure(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 4)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc, 10 ms resolution), else None."""
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat") as f:
            stat = f.read()
    except (OSError, ValueError, IndexError):
        return None
    # Field 22 (starttime, clock ticks after boot) counts from after the ")" of the name.
    start_ticks = int(stat[stat.rfind(")") + 2 :].split()[19])
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
