"""The KV cache's host memory is checked against what is free and faulted in at start."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from kvflow.errors import ConfigError
from kvflow.gpu_worker import host_memory
from kvflow.gpu_worker.kv_cache import KVCacheSpec, allocate_kv_cache


def resident_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


def test_available_bytes_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemAvailable:   2048 kB\n")
    assert host_memory.available_bytes(meminfo) == 2048 * 1024
    assert host_memory.available_bytes(tmp_path / "missing") is None


def test_a_cache_larger_than_free_memory_fails_before_allocating() -> None:
    free = host_memory.available_bytes()
    if free is None:
        pytest.skip("the host does not report MemAvailable")
    spec = KVCacheSpec(
        num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32
    )
    num_blocks = free // spec.bytes_per_block + 1024
    before = resident_bytes()
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        allocate_kv_cache(spec, num_blocks, torch.device("cpu"))
    assert resident_bytes() - before < 64 << 20  # refused, not half-allocated


def resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the tensor's pages in memory now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = tensor.data_ptr() & ~(page - 1)
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(b & 1 for b in vec) / pages


def test_the_cache_is_resident_after_allocation() -> None:
    spec = KVCacheSpec(
        num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16
    )
    num_blocks = (192 << 20) // spec.bytes_per_block  # > glibc's mmap threshold: fresh pages
    caches = allocate_kv_cache(spec, num_blocks, torch.device("cpu"))
    # Every page is in memory: no first-touch faults left. (Without the reservation a
    # fresh mapping's pages are not, unless the allocator handed back memory this process
    # had touched before: so the test asserts the outcome, not the contrast.)
    assert resident_fraction(caches[0]) == 1.0
    assert resident_fraction(caches[-1]) == 1.0
    assert len(caches) == 4 and caches[0].shape[1] == num_blocks
