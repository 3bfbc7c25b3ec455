"""dtype=auto on CPU: the measured choice, its threshold and its cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.device_resolution import resolve_dtype
from kvflow.metrics import dtype_choice
from kvflow.metrics.dtype_choice import (
    BF16_MIN_SPEEDUP,
    DTypeChoice,
    choose_cpu_dtype,
    faster_dtype,
    measure_cpu_dtype,
)


def test_bfloat16_only_when_clearly_faster() -> None:
    assert faster_dtype(200.0, 150.0) == "float32"  # a Xeon with AVX512-BF16, no AMX
    assert faster_dtype(200.0, 200.0 * BF16_MIN_SPEEDUP * 0.99) == "float32"  # a near tie
    assert faster_dtype(200.0, 200.0 * BF16_MIN_SPEEDUP) == "bfloat16"
    assert faster_dtype(150.0, 800.0) == "bfloat16"  # AMX, or full-width AVX512-BF16


def test_measurement_is_consistent_with_its_rates() -> None:
    choice = measure_cpu_dtype(threads=1)
    assert choice.float32_gflops > 0 and choice.bfloat16_gflops > 0
    assert choice.dtype == faster_dtype(choice.float32_gflops, choice.bfloat16_gflops)
    assert choice.source == "measured"


def test_measured_once_then_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int | None] = []

    def fake_measure(threads: int | None = None) -> DTypeChoice:
        calls.append(threads)
        return DTypeChoice("float32", 250.0, 140.0, "measured")

    monkeypatch.setattr(dtype_choice, "measure_cpu_dtype", fake_measure)
    cache = tmp_path / "dtype_choice.json"
    first = choose_cpu_dtype(cache, threads=2)
    second = choose_cpu_dtype(cache, threads=2)
    assert (first.dtype, first.source) == ("float32", "measured")
    assert second == DTypeChoice("float32", 250.0, 140.0, "cached")
    assert calls == [2]
    choose_cpu_dtype(cache, threads=1)  # another thread count is another machine
    assert calls == [2, 1]


def test_resolve_dtype_auto_on_cpu_uses_the_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    fake = DTypeChoice("bfloat16", 100.0, 700.0, "measured")
    monkeypatch.setattr(dtype_choice, "measure_cpu_dtype", lambda threads=None: fake)
    assert resolve_dtype("auto", "cpu") == "bfloat16"
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("float32", "cpu") == "float32"
