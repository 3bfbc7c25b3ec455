"""The roofline section of the offline benchmarks (`bench throughput`, `bench latency`).

The engine counts step time and estimated FLOPs / bytes per phase (kvflow/metrics/roofline.py);
this turns them into achieved FLOP/s and bytes/s and their % of the device's peaks
(kvflow/metrics/device_peaks.py), separately for prefill-heavy and decode-heavy steps. Step time
is the model runner's `execute` (forward + sampling), timed in this process. A cached
CPU calibration that a phase just beat (taken on a busy machine) is redone first. On
the CPU, a read pass over the model's own weights, just after the run, gives the decode
steps the read roof of the very pages they stream (kvflow/metrics/weight_read.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvflow.metrics.device_peaks import recalibrate_if_exceeded, resolve_peaks
from kvflow.metrics.roofline import roofline_report
from kvflow.metrics.weight_read import model_read_roof

if TYPE_CHECKING:
    from kvflow.offline.engine import LLMEngine

_LABELS = {"prefill": "prefill-heavy steps", "decode": "decode-heavy steps"}


def roofline_section(engine: LLMEngine) -> dict[str, Any]:
    """JSON-ready: the peaks used and, per phase that ran, the achieved rates."""
    config = engine.config
    device, dtype = config.device.device, config.model.dtype
    peaks = resolve_peaks(device, dtype, config.device.peak_flops, config.device.peak_bandwidth)
    totals = engine.roofline.phases
    rates = [(t.flops / t.seconds, t.bytes / t.seconds) for t in totals.values() if t.seconds > 0]
    if rates:  # a stale calibration below what was just achieved is redone
        best_flops, best_bandwidth = max(r[0] for r in rates), max(r[1] for r in rates)
        peaks = recalibrate_if_exceeded(device, dtype, peaks, best_flops, best_bandwidth)
    phases = roofline_report(totals, peaks.flops, peaks.bandwidth)
    section: dict[str, Any] = {
        "peak_flops": peaks.flops,
        "peak_bandwidth": peaks.bandwidth,
        "peaks_source": peaks.source,
        "phases": phases,
    }
    weight_read = model_read_roof(engine)  # the weights' own pages, read just now
    decode_gbs = phases.get("decode", {}).get("gb_per_s")
    if weight_read is not None and decode_gbs is not None and weight_read["read_gb_per_s"] > 0:
        share = 100 * decode_gbs / weight_read["read_gb_per_s"]
        section["weight_read"] = {**weight_read, "pct_decode_of_read": round(share, 1)}
    return section


def roofline_lines(section: dict[str, Any]) -> list[str]:
    """Human-readable: one line for the peaks, one per phase."""
    lines = [
        f"roofline (peaks {section['peak_flops'] / 1e9:.1f} GFLOP/s, "
        f"{section['peak_bandwidth'] / 1e9:.1f} GB/s; {section['peaks_source']}):"
    ]
    for phase, row in section["phases"].items():
        lines.append(
            f"  {_LABELS[phase]:>19}: {_pct(row['pct_compute_roofline'])} of compute roofline"
            f" / {_pct(row['pct_bandwidth_roofline'])} of bandwidth roofline"
            f" ({row['gflop_per_s']} GFLOP/s, {row['gb_per_s']} GB/s,"
            f" {row['steps']} steps in {row['seconds']:.2f} s)"
        )
    if "weight_read" in section:
        read = section["weight_read"]
        lines.append(
            f"  a read pass over the model's {read['weight_bytes'] / 1e9:.2f} GB of weights, "
            f"same pages, just after: {read['read_gb_per_s']} GB/s; decode-heavy steps reach "
            f"{read['pct_decode_of_read']}% of it"
        )
    return lines


def _pct(value: float | None) -> str:
    if value is None:
        return "?%"
    return f"{value:.1f}%" if value >= 1 else f"{value:.2f}%"
