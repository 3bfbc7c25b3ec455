"""`kvflow bench kernels`: time each kernel and place it on the device's roofline.

For every kernel the bench counts the bytes it must move and the flops it must do (the
minimum: each input read once, each output written once), times it, and prints time,
GB/s, GFLOP/s and the % of the device's peak bandwidth and bf16 dense tensor throughput.
Decode attention (batch 64 x 2k context by default) is also timed against torch
baselines: gather + SDPA (what the torch backend does) and SDPA on K/V already gathered
into contiguous tensors (the best a dense kernel can do without paging). On the CPU,
small-batch linear layers are timed too: in float32, float32 weights and each GGUF block
format, F.linear against kvflow's routes; in bfloat16, F.linear, oneDNN on packed
weights and the native bf16 GEMM.

On a CUDA device the Triton kernels run, timed with CUDA events around `--iters` calls
back to back: the queue stays full, so the host's launch work (Python checks, Triton's
argument handling) overlaps the kernels before it, as it does in a running engine (and
CUDA graphs remove it there). Timing one call between two events counted that host
work too: on an H100, 0.38 ms for a decode-attention call whose kernel takes 0.21 ms.
Without one, the torch
references and baselines run, plus the native CPU decode attention of the `cpu` backend
(timed with perf_counter), and the output says so: interpreted Triton kernels are far
too slow for a timing to mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvflow.bench.kernel_cases import (
    Case,
    attention_cases,
    cpu_bf16_linear_cases,
    cpu_linear_cases,
    elementwise_cases,
    store_and_mask_cases,
)
from kvflow.kernels.launch_utils import kernels_interpreted

# Peak HBM bandwidth (GB/s) and bf16 dense tensor throughput (TFLOP/s), by device name.
PEAKS: dict[str, tuple[float, float]] = {"H200": (4800.0, 989.0), "H100": (3350.0, 989.0)}


@dataclass
class Measurement:
    kernel: str
    impl: str
    time_ms: float
    gb_per_s: float
    gflop_per_s: float
    pct_peak_bandwidth: float | None
    pct_peak_flops: float | None


def _peaks(args: argparse.Namespace, device: torch.device) -> tuple[float | None, float | None]:
    bandwidth, tflops = None, None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        bandwidth, tflops = next((p for key, p in PEAKS.items() if key in name), (None, None))
    if args.peak_bandwidth_gbs is not None:
        bandwidth = args.peak_bandwidth_gbs
    if args.peak_tflops is not None:
        tflops = args.peak_tflops
    return bandwidth, tflops


def _time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Milliseconds of one call: on a GPU the mean of `iters` calls back to back between
    two CUDA events; on a CPU the median of `iters` calls timed with perf_counter."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def _measure(
    case: Case, impl: str, ms: float, peaks: tuple[float | None, float | None]
) -> Measurement:
    gbs = case.bytes / (ms * 1e-3) / 1e9
    gflops = case.flops / (ms * 1e-3) / 1e9
    bandwidth, tflops = peaks
    return Measurement(
        kernel=case.name,
        impl=impl,
        time_ms=round(ms, 4),
        gb_per_s=round(gbs, 1),
        gflop_per_s=round(gflops, 1),
        pct_peak_bandwidth=None if bandwidth is None else round(100 * gbs / bandwidth, 1),
        pct_peak_flops=None if tflops is None else round(100 * gflops / (tflops * 1e3), 2),
    )


def _impls_to_run(device: torch.device) -> tuple[set[str], str]:
    """Which implementations this device times, and a note that says so."""
    if device.type == "cuda" and not kernels_interpreted():
        # The per-request Python loop of the attention reference is no baseline on a GPU.
        return {"triton", "torch", "torch-gather+sdpa", "torch-sdpa(contiguous kv)"}, "triton"
    note = "torch references and native CPU kernels: no CUDA device, Triton kernels are not timed"
    impls = {"torch", "torch-ref", "torch-gather+sdpa", "torch-sdpa(contiguous kv)", "cpu-native"}
    impls.add("cpu-int8")  # `--quantization`'s kernel on the GGUF formats
    impls.add("cpu-onednn")  # oneDNN on packed bf16 weights, the native GEMM's baseline
    impls.add("cpu-vnni")  # `--quantization gguf`'s VNNI block kernel at 1-2 rows
    impls.add("cpu-native(avx2 build)")  # the paged decode's loops for CPUs without AVX-512
    return impls, note


def run_kernel_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Time every kernel (see module docstring); print a table or JSON, return the report."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    on_gpu = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (10 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (50 if on_gpu else 3)
    peaks = _peaks(args, device)
    impls, mode = _impls_to_run(device)
    results: list[Measurement] = []
    with torch.inference_mode():
        builds = (store_and_mask_cases, elementwise_cases, attention_cases, cpu_linear_cases)
        for build in (*builds, cpu_bf16_linear_cases):
            for case in build(args, device, dtype):
                for impl, fn in case.impls.items():
                    if impl in impls:
                        ms = _time_ms(fn, device, warmup, iters)
                        results.append(_measure(case, impl, ms, peaks))
    report = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "mode": mode,
        "dtype": args.dtype,
        "peak_bandwidth_gbs": peaks[0],
        "peak_tflops": peaks[1],
        "results": [asdict(m) for m in results],
        "decode_attention_speedup": _speedups(results, "decode_attention"),
    }
    print(json.dumps(report) if args.json else _table(report))
    return report


FAST_IMPLS = ("triton", "cpu-native")  # kvflow's own kernels, in order of preference


def _speedups(results: list[Measurement], kernel_prefix: str) -> dict[str, float]:
    """Baseline time / kvflow kernel time (Triton, else native CPU) for each baseline of
    the kernel; empty when neither ran."""
    rows = [m for m in results if m.kernel.startswith(kernel_prefix)]
    ours = next((m for impl in FAST_IMPLS for m in rows if m.impl == impl), None)
    if ours is None:
        return {}
    return {
        f"{ours.impl} vs {m.impl}": round(m.time_ms / ours.time_ms, 2)
        for m in rows
        if m.impl not in FAST_IMPLS
    }


def _table(report: dict[str, Any]) -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}%"

    lines = [
        f"device: {report['device']}  dtype: {report['dtype']}  mode: {report['mode']}",
        f"peaks: {report['peak_bandwidth_gbs']} GB/s, {report['peak_tflops']} TFLOP/s",
        f"{'kernel':<34} {'impl':<26} {'ms':>9} {'GB/s':>9} {'GFLOP/s':>10} {'%BW':>7} {'%FLOP':>7}",
    ]
    for m in report["results"]:
        lines.append(
            f"{m['kernel']:<34} {m['impl']:<26} {m['time_ms']:>9.3f} {m['gb_per_s']:>9.1f} "
            f"{m['gflop_per_s']:>10.1f} {pct(m['pct_peak_bandwidth']):>7} "
            f"{pct(m['pct_peak_flops']):>7}"
        )
    for name, ratio in report["decode_attention_speedup"].items():
        lines.append(f"decode attention speedup, {name}: {ratio}x")
    return "\n".join(lines)
