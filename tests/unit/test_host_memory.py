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


_TRIM_CHILD = """
import ctypes, psutil, torch
from kvflow.gpu_worker.host_memory import return_freed_heap
libc = ctypes.CDLL("libc.so.6")
assert libc.mallopt(-3, 32 << 20) == 1  # M_MMAP_THRESHOLD: every block from the heap
assert libc.mallopt(-1, 1 << 30) == 1  # M_TRIM_THRESHOLD: free() never trims by itself
rss = lambda: psutil.Process().memory_info().rss
blocks = [torch.ones(1 << 19) for _ in range(128)]  # 128 x 2 MiB, written
held = rss()
del blocks
freed = rss()
return_freed_heap()
print(held >> 20, freed >> 20, rss() >> 20)
"""


@pytest.mark.skipif(host_memory._malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_freed_heap_goes_back_to_the_os() -> None:
    """Tensors freed on the heap stay resident (as packed weights' plain copies did)
    until return_freed_heap; a child process, so that glibc's settings stay its own."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _TRIM_CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    held, freed, trimmed = (int(v) for v in done.stdout.split())
    assert freed > held - 32  # freeing alone returned (almost) nothing
    assert trimmed < held - 200  # 256 MiB were freed


def test_packing_returns_the_plain_weights_as_it_goes(monkeypatch) -> None:
    from kvflow.gpu_worker import weight_packing
    from kvflow.gpu_worker.layers.linear import RowParallelLinear

    calls = []
    monkeypatch.setattr(weight_packing, "return_freed_heap", lambda: calls.append(1))
    monkeypatch.setattr(weight_packing, "_TRIM_BYTES", 3 * 64 * 128 * 4)
    model = torch.nn.Sequential(*[RowParallelLinear(128, 64, bias=False) for _ in range(7)])
    assert weight_packing.pack_weights(model) == 7
    assert len(calls) == 2 + 1  # after layers 3 and 6, and once at the end
    assert all(layer.weight.numel() == 0 for layer in model)
