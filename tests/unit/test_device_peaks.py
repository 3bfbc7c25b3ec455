"""Device peaks: the GPU table by name, flags overriding, and the CPU calibration
measured once and then read from its cache file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvflow.metrics import device_peaks
from kvflow.metrics.device_peaks import DevicePeaks, calibrate, gpu_table_peaks, resolve_peaks


@pytest.mark.parametrize(
    ("name", "tflops", "gb_per_s"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0, 3350.0),
        ("NVIDIA H100 PCIe", 756.0, 2000.0),
        ("NVIDIA H100 NVL", 835.0, 3900.0),
        ("NVIDIA H200", 989.0, 4800.0),
        ("NVIDIA H20", 148.0, 4000.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 2039.0),
        ("NVIDIA A100 80GB PCIe", 312.0, 1935.0),
        ("NVIDIA A100-SXM4-40GB", 312.0, 1555.0),
        ("NVIDIA A10", 125.0, 600.0),
        ("NVIDIA L4", 121.0, 300.0),
        ("NVIDIA L40S", 362.0, 864.0),
    ],
)
def test_gpu_table(name: str, tflops: float, gb_per_s: float) -> None:
    assert gpu_table_peaks(name) == DevicePeaks(tflops * 1e12, gb_per_s * 1e9, f"table: {name}")


def test_unknown_gpu_is_not_guessed() -> None:
    assert gpu_table_peaks("NVIDIA A10G") is None
    assert gpu_table_peaks("Tesla T4") is None


def test_cpu_calibration_runs_once_then_comes_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "peaks.json"
    calls: list[tuple[str, str, int, int]] = []

    def fake_calibrate(device: str, dtype: str, size: int, copy_bytes: int) -> DevicePeaks:
        calls.append((device, dtype, size, copy_bytes))
        return DevicePeaks(2e11, 1e10, "calibrated")

    monkeypatch.setattr(device_peaks, "calibrate", fake_calibrate)
    first = resolve_peaks("cpu", "bfloat16", cache_file=cache)
    assert first == DevicePeaks(2e11, 1e10, "calibrated")
    assert calls == [("cpu", "bfloat16", 1024, 64 << 20)]
    again = resolve_peaks("cpu", "bfloat16", cache_file=cache)
    assert again == DevicePeaks(2e11, 1e10, "cached calibration")
    assert len(calls) == 1
    (key,) = json.loads(cache.read_text())
    assert key.endswith(f"|{torch.get_num_threads()} threads|bfloat16")
    resolve_peaks("cpu", "float32", cache_file=cache)  # another dtype: its own entry
    assert len(calls) == 2 and len(json.loads(cache.read_text())) == 2


def test_flags_override_each_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "peaks.json"
    monkeypatch.setattr(device_peaks, "calibrate", lambda *a: DevicePeaks(2e11, 1e10, "calibrated"))
    both = resolve_peaks("cpu", "float32", 5e12, 6e11, cache_file=cache)
    assert both == DevicePeaks(5e12, 6e11, "flags")
    assert not cache.exists()  # nothing measured when both are given
    flops_only = resolve_peaks("cpu", "float32", peak_flops=5e12, cache_file=cache)
    assert flops_only == DevicePeaks(5e12, 1e10, "flags + calibrated")


def test_real_calibration_on_a_small_shape() -> None:
    peaks = calibrate("cpu", "float32", matmul_size=64, copy_bytes=1 << 20)
    assert peaks.source == "calibrated"
    # 64^3 * 2 FLOPs and 2 MiB moved take microseconds; the lower bounds leave room for a
    # run descheduled for tens of milliseconds on a loaded 2-core machine.
    assert 1e5 < peaks.flops < 1e14
    assert 1e6 < peaks.bandwidth < 1e13


def test_a_calibration_below_a_measured_rate_is_redone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "peaks.json"
    fresh = iter([DevicePeaks(5e10, 9e9, "calibrated"), DevicePeaks(1.3e11, 8e9, "calibrated")])
    monkeypatch.setattr(device_peaks, "calibrate", lambda *args: next(fresh))
    busy = resolve_peaks("cpu", "float32", cache_file=cache)  # taken on a busy machine
    assert busy.flops == 5e10
    # Below what the engine achieved: redone, each roof the higher of old and new.
    raised = device_peaks.recalibrate_if_exceeded("cpu", "float32", busy, 9e10, 1e9, cache)
    assert raised == DevicePeaks(1.3e11, 9e9, "recalibrated")
    assert resolve_peaks("cpu", "float32", cache_file=cache) == DevicePeaks(
        1.3e11, 9e9, "cached calibration"
    )
    # Within the roofs, or from flags / the GPU table: left alone (no calibration).
    assert (
        device_peaks.recalibrate_if_exceeded("cpu", "float32", raised, 1e11, 1e9, cache) is raised
    )
    flags = DevicePeaks(1e9, 1e9, "flags")
    assert device_peaks.recalibrate_if_exceeded("cpu", "float32", flags, 1e12, 1e12, cache) is flags
