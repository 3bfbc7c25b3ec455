"""Tensors on transparent huge pages: the weights a decode step streams from DRAM.

A one-row decode step reads every weight once, so its speed is the DRAM read rate
(docs/benchmarks.md, "W2"). On 4 KiB pages that read crosses a page every 4 KiB: each
crossing costs a TLB walk, and the hardware prefetchers stop at page boundaries. A
2 MiB huge page removes both; on the Zen 4 sitting the one-row GEMMs of the 1B shape
streamed their weights faster on huge pages (docs/benchmarks.md, "Weights on huge
pages"). The KV cache takes them too (gpu_worker/host_memory.py).

`empty(shape, dtype)` is torch.empty on a 2 MiB-aligned range advised `MADV_HUGEPAGE`
before its first touch, so the pages are huge from the first write: no copy and no
collapse later (collapsing populated 4 KiB pages into huge ones ran at ~0.5 GB/s).
Below 2 MiB, or where the kernel has no THP (another OS, or THP set to `never`),
it is plain torch.empty. The kernel may still decline (no free huge page): then the
range is ordinary pages, and only the speed differs.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@functools.cache
def thp_available() -> bool:
    """Whether this kernel gives transparent huge pages to a range that asks for them."""
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    return _libc() is not None and "[never]" not in setting


def advise(address: int, nbytes: int) -> int:
    """Ask for huge pages over the whole 2 MiB pages inside [address, address + nbytes)
    (the partial ones at the ends are left as they are: they may belong to other
    allocations); returns the bytes advised, 0 where nothing was."""
    libc = _libc()
    first = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if libc is None or end <= first:
        return 0
    status = libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_HUGEPAGE)
    return end - first if status == 0 else 0


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor that starts on a huge-page boundary and is advised
    huge pages before anything touches it (see the module docstring)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not thp_available():
        return torch.empty(shape, dtype=dtype)
    # A fresh anonymous mapping: its pages are untouched (malloc may hand back pages that
    # another tensor faulted in as small ones). The tensor keeps the mapping alive.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    mapping.madvise(_MADV_HUGEPAGE, offset, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor, on huge pages as `empty` gives them."""
    out = empty(tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return out
