"""The KV cache's host memory, reserved at start rather than on first touch.

`torch.empty` on CPU maps pages that the OS fills on first write, so without this the
first steps of serving pay the page faults and a `--kv-cache-memory` beyond what the
host has free fails mid-serving (the OOM killer) instead of at start. `reserve`:

1. checks the size against MemAvailable and refuses, with the flag to change, what
   cannot fit;
2. asks for transparent huge pages (kernels/cpu/huge_pages.py: fewer faults now, fewer
   TLB misses in attention later; the kernel may decline);
3. populates every page (`MADV_POPULATE_WRITE`, Linux >= 5.14; else a write of zeros).

`return_freed_heap` hands memory that was freed back to the OS. Packing the weights frees
each plain weight as its packed copy is made, but glibc keeps freed heap chunks mapped:
at the Qwen2.5-3B shape that left 3.6 GiB resident that no tensor held (14.3 GiB for
10.6 GiB of weights and KV cache), more than vLLM's whole server.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvflow.errors import ConfigError
from kvflow.kernels.cpu import huge_pages

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable, or None where the host does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(nbytes: int, what: str, option: str) -> None:
    """ConfigError if `nbytes` more would not fit in the host's available memory."""
    free = available_bytes()
    if free is not None and nbytes > free:
        raise ConfigError(
            f"{what} needs {nbytes / (1 << 30):.2f} GiB but this host has "
            f"{free / (1 << 30):.2f} GiB available; lower {option}"
        )


def reserve(tensor: torch.Tensor) -> float:
    """Fault in every page of a CPU tensor now; returns the seconds it took."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0.0
    start = time.perf_counter()
    nbytes = tensor.numel() * tensor.element_size()
    if not _populate(tensor.data_ptr(), nbytes):
        tensor.zero_()
    seconds = time.perf_counter() - start
    logger.info("reserved %.2f GiB of host memory in %.2f s", nbytes / (1 << 30), seconds)
    return seconds


def _populate(address: int, nbytes: int) -> bool:
    """madvise the range (huge pages, then populate); False where populate is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    page = mmap.PAGESIZE
    first = address & ~(page - 1)
    length = address + nbytes - first
    huge_pages.advise(address, nbytes)
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0:
        return True
    error = ctypes.get_errno()
    if error == errno.ENOMEM:
        raise ConfigError(
            f"could not reserve {nbytes / (1 << 30):.2f} GiB for the KV cache (out of "
            "memory); lower --kv-cache-memory"
        )
    return False  # EINVAL: a kernel without MADV_POPULATE_WRITE


def return_freed_heap() -> None:
    """glibc's malloc_trim(0): unmap free heap memory. No-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
