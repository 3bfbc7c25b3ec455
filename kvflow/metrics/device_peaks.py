"""The device's peak FLOP/s and memory bandwidth: the two roofs of the roofline.

In order of precedence:
1. flags (`--peak-flops`, `--peak-bandwidth`), each on its own;
2. on CUDA with a 16-bit dtype, the vendor's dense (no sparsity) bf16 tensor-core and
   memory-bandwidth figures of known GPUs, by device name;
3. otherwise a short calibration on the device itself: the best of a few
   `[n, n] @ [n, n]` matmuls at the dtype in use (n = 1024 on CPU), and the best of a
   few copies of a 64 MiB tensor on CPU (read + write = 128 MiB moved: more than the
   L3 of common server CPUs; 512 MiB on GPUs). About 0.2 s on CPU; the result is cached in
   <cache>/device_peaks.json keyed by device model, thread count and dtype, so only
   the first start on a machine pays for it.
A calibrated peak is what this machine reaches with torch, not the datasheet's figure.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvflow.cache_dir import cpu_model, default_cache_dir, read_json, write_json_atomically

logger = logging.getLogger(__name__)

# (device-name pattern, bf16 dense TFLOP/s, memory GB/s). First match wins.
GPU_PEAKS: list[tuple[str, float, float]] = [
    (r"GH200", 989.0, 4000.0),
    (r"H200", 989.0, 4800.0),
    (r"H100.*NVL", 835.0, 3900.0),
    (r"H100.*PCIe", 756.0, 2000.0),
    (r"H100|H800", 989.0, 3350.0),  # SXM5 (the name says "H100 80GB HBM3")
    (r"\bH20\b", 148.0, 4000.0),
    (r"B200", 2250.0, 8000.0),
    (r"A100.*SXM4.*80GB", 312.0, 2039.0),
    (r"A100.*80GB.*PCIe", 312.0, 1935.0),
    (r"A100", 312.0, 1555.0),  # the 40 GB parts
    (r"L40S", 362.0, 864.0),
    (r"\bL40\b", 181.0, 864.0),
    (r"\bL4\b", 121.0, 300.0),
    (r"\bA10\b", 125.0, 600.0),
    (r"RTX 4090", 165.0, 1008.0),
    (r"RTX 3090", 71.0, 936.0),
]
CPU_MATMUL_SIZE = 1024
GPU_MATMUL_SIZE = 8192
CPU_COPY_BYTES = 64 << 20
GPU_COPY_BYTES = 512 << 20  # 64 MiB would take ~40 us on HBM: too short to time
_REPEATS = 5
_BUDGET_S = 0.1  # per measurement: the whole calibration stays well under 0.5 s


@dataclass(frozen=True)
class DevicePeaks:
    flops: float  # FLOP/s at the dtype in use; 0 = unknown
    bandwidth: float  # bytes/s of device memory; 0 = unknown
    source: str  # "table: <name>", "calibrated", "cached calibration", "flags", ...


def gpu_table_peaks(device_name: str) -> DevicePeaks | None:
    """The known figures for a GPU name as torch reports it, or None."""
    for pattern, tflops, gb_per_s in GPU_PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return DevicePeaks(tflops * 1e12, gb_per_s * 1e9, f"table: {device_name}")
    return None


def calibrate(device: str, dtype: str, matmul_size: int, copy_bytes: int) -> DevicePeaks:
    """Best-of-`_REPEATS` matmul FLOP/s and copy bytes/s on `device` (after a warm-up)."""
    import torch

    matmul_s = _matmul_seconds(device, getattr(torch, dtype), matmul_size)
    copy_s = _copy_seconds(device, copy_bytes)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the KV cache is sized from the free memory next
    return DevicePeaks(2 * matmul_size**3 / matmul_s, 2 * copy_bytes / copy_s, "calibrated")


def _matmul_seconds(device: str, dtype: Any, size: int) -> float:
    import torch

    a = torch.randn(size, size, device=device).to(dtype)  # [n, n]
    b = torch.randn(size, size, device=device).to(dtype)  # [n, n]
    return _best_time(lambda: torch.matmul(a, b), device)


def _copy_seconds(device: str, num_bytes: int) -> float:
    import torch

    source = torch.ones(num_bytes, dtype=torch.uint8, device=device)  # [num_bytes]
    target = torch.empty_like(source)
    return _best_time(lambda: target.copy_(source), device)


def _best_time(work: Callable[[], object], device: str) -> float:
    """The fastest of up to `_REPEATS` timed runs (at least 2; no new one once
    `_BUDGET_S` is spent), after one untimed warm-up run."""
    import torch

    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    work()  # warm-up: first-touch page faults, kernel selection
    times: list[float] = []
    deadline = time.perf_counter() + _BUDGET_S
    while len(times) < _REPEATS and (len(times) < 2 or time.perf_counter() < deadline):
        synchronize()
        start = time.perf_counter()
        work()
        synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def cached_calibration(device: str, dtype: str, cache_file: Path) -> DevicePeaks:
    """`calibrate` once per (device model, threads, dtype); later from `cache_file`."""
    key = _calibration_key(device, dtype)
    cached = read_json(cache_file)
    if key in cached:
        entry = cached[key]
        return DevicePeaks(float(entry["flops"]), float(entry["bandwidth"]), "cached calibration")
    peaks = _calibrate_device(device, dtype)
    _store_calibration(cache_file, key, peaks)
    return peaks


def recalibrate_if_exceeded(
    device: str,
    dtype: str,
    peaks: DevicePeaks,
    achieved_flops: float,
    achieved_bandwidth: float,
    cache_file: Path | None = None,
) -> DevicePeaks:
    """A rate the engine achieved is a lower bound of the device's peak, so a calibration
    below it was taken while the machine was busy (shared VMs). Then calibrate again and
    keep, and cache, the higher of old and new for each roof; else return `peaks`."""
    if peaks.source not in ("calibrated", "cached calibration"):
        return peaks  # vendor figures and flags are taken as given
    if achieved_flops <= peaks.flops and achieved_bandwidth <= peaks.bandwidth:
        return peaks
    fresh = _calibrate_device(device, dtype)
    best = DevicePeaks(
        max(peaks.flops, fresh.flops), max(peaks.bandwidth, fresh.bandwidth), "recalibrated"
    )
    logger.info(
        "a measured rate exceeded the cached roofs (%.1f GFLOP/s, %.1f GB/s): recalibrated "
        "to %.1f GFLOP/s, %.1f GB/s",
        peaks.flops / 1e9, peaks.bandwidth / 1e9, best.flops / 1e9, best.bandwidth / 1e9,
    )  # fmt: skip
    _store_calibration(cache_file or default_cache_file(), _calibration_key(device, dtype), best)
    return best


def _calibrate_device(device: str, dtype: str) -> DevicePeaks:
    on_gpu = device.startswith("cuda")
    return calibrate(
        device,
        dtype,
        GPU_MATMUL_SIZE if on_gpu else CPU_MATMUL_SIZE,
        GPU_COPY_BYTES if on_gpu else CPU_COPY_BYTES,
    )


def _store_calibration(cache_file: Path, key: str, peaks: DevicePeaks) -> None:
    cached = read_json(cache_file)
    cached[key] = {k: v for k, v in asdict(peaks).items() if k != "source"}
    write_json_atomically(cache_file, cached)
    logger.info(
        "calibrated %s: %.1f GFLOP/s, %.1f GB/s", key, peaks.flops / 1e9, peaks.bandwidth / 1e9
    )


def resolve_peaks(
    device: str,
    dtype: str,
    peak_flops: float | None = None,
    peak_bandwidth: float | None = None,
    cache_file: Path | None = None,
) -> DevicePeaks:
    """The roofs for `device` ("cpu" | "cuda[:i]") at `dtype`; flags override each one."""
    if peak_flops is not None and peak_bandwidth is not None:
        return DevicePeaks(peak_flops, peak_bandwidth, "flags")
    peaks = None
    if device.startswith("cuda") and dtype in ("bfloat16", "float16"):
        import torch

        peaks = gpu_table_peaks(torch.cuda.get_device_name(device))
    if peaks is None:
        peaks = cached_calibration(device, dtype, cache_file or default_cache_file())
    if peak_flops is None and peak_bandwidth is None:
        return peaks
    return DevicePeaks(
        peak_flops if peak_flops is not None else peaks.flops,
        peak_bandwidth if peak_bandwidth is not None else peaks.bandwidth,
        f"flags + {peaks.source}",
    )


def default_cache_file() -> Path:
    return default_cache_dir() / "device_peaks.json"


def _calibration_key(device: str, dtype: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}|{dtype}"
    return f"{cpu_model()}|{torch.get_num_threads()} threads|{dtype}"
