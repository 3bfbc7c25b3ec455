"""`kvflow bench serve --plot FILE.png`: latency-throughput curves and request timelines.

The data (`curve_point`, `timeline_rows`) is computed here without matplotlib; only the
`draw_*` functions import it, lazily, so the server and the benchmark itself never need
it (it belongs to the bench/dev dependencies).

Timeline of one request (seconds from the run's start):

    queued ░░░░ sent ▒▒▒▒▒▒▒▒ first token ████████████████ end
           waiting for a       TTFT: queueing in the     decode: the remaining
           --max-concurrency   server + prefill          chunks
           slot (client side)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.bench.request_client import RequestOutput
from kvflow.bench.serve_metrics import METRIC_NAMES, calculate_metrics

CURVE_PERCENTILE = 99.0


@dataclass(frozen=True)
class CurvePoint:
    """One run of a rate sweep: achieved throughput and latency (ms) per metric."""

    rate: float
    request_throughput: float
    output_throughput: float
    median_ms: dict[str, float]
    p99_ms: dict[str, float]


@dataclass(frozen=True)
class TimelineRow:
    """One request's phases, in seconds from the run's start (see the diagram)."""

    queued: float
    sent: float
    first_token: float
    end: float
    success: bool


def curve_point(
    rate: float,
    outputs: Sequence[RequestOutput],
    duration_s: float,
    count_tokens: Callable[[str], int],
) -> CurvePoint:
    metrics = calculate_metrics(outputs, duration_s, [CURVE_PERCENTILE], {}, count_tokens)
    return CurvePoint(
        rate=rate,
        request_throughput=metrics.request_throughput,
        output_throughput=metrics.output_throughput,
        median_ms={name: metrics.stats[name].median for name in METRIC_NAMES},
        p99_ms={name: metrics.stats[name].percentiles[0][1] for name in METRIC_NAMES},
    )


def timeline_rows(outputs: Sequence[RequestOutput], start_time: float) -> list[TimelineRow]:
    """Rows in the order requests were due; a failed request ends when it was sent
    plus its measured latency (0: it failed at once) and has no first token."""
    rows = []
    for out in sorted(outputs, key=lambda o: (o.queued_time, o.start_time)):
        sent = out.start_time - start_time
        first = sent + out.ttft if out.success else sent
        rows.append(
            TimelineRow(out.queued_time - start_time, sent, first, sent + out.latency, out.success)
        )
    return rows


def require_matplotlib() -> None:
    """Fail before a long benchmark, not after it, when --plot cannot be drawn."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def draw_curves(points: Sequence[CurvePoint], path: Path) -> None:
    """Median and P99 of TTFT, TPOT, ITL and E2EL against achieved output tok/s; each
    point labelled with the request rate that produced it."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))  # one panel per METRIC_NAMES entry
    ordered = sorted(points, key=lambda p: p.output_throughput)
    xs = [p.output_throughput for p in ordered]
    for ax, name in zip(axes.flat, METRIC_NAMES):
        ax.plot(xs, [p.median_ms[name] for p in ordered], marker="o", label="median")
        ax.plot(xs, [p.p99_ms[name] for p in ordered], marker="s", label="P99")
        for p in ordered:
            ax.annotate(f"{p.rate:g} req/s", (p.output_throughput, p.median_ms[name]), fontsize=7)
        ax.set_title(name.upper())
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel("latency (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_timeline(rows: Sequence[TimelineRow], path: Path) -> None:
    """One horizontal bar per request: queued (grey), TTFT (orange), decode (blue);
    failed requests in red."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.12 * len(rows) + 1.5)))
    for y, row in enumerate(rows):
        if not row.success:
            ax.barh(y, max(row.end - row.sent, 1e-3), left=row.sent, color="tab:red")
            continue
        ax.barh(y, row.sent - row.queued, left=row.queued, color="lightgrey")
        ax.barh(y, row.first_token - row.sent, left=row.sent, color="tab:orange")
        ax.barh(y, row.end - row.first_token, left=row.first_token, color="tab:blue")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c) for c in ("lightgrey", "tab:orange", "tab:blue")
    ]
    ax.legend(handles, ["queued (client)", "to first token", "decode"], loc="lower right")
    ax.set_xlabel("seconds from the start of the run")
    ax.set_ylabel("request (in arrival order)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
