"""The report parts of `bench startup` (flags passed through, mean/min) and of the
offline benches' roofline section, on made-up numbers."""

from __future__ import annotations

from types import SimpleNamespace

from kvflow.bench.roofline import roofline_lines, roofline_section
from kvflow.bench.startup import StartupRun, report_lines, serve_flags, summarize
from kvflow.config import EngineConfig
from kvflow.metrics.roofline import RooflineMeter
from kvflow.proto.stats import PhaseTotals


def test_engine_options_become_serve_flags() -> None:
    options = {"model": "/m", "block_size": 32, "enable_prefix_caching": False, "dtype": "auto"}
    assert serve_flags(options) == [
        "--model",
        "/m",
        "--block-size",
        "32",
        "--no-enable-prefix-caching",
        "--dtype",
        "auto",
    ]
    assert serve_flags({"enforce_eager": True}) == ["--enforce-eager"]


def test_startup_summary_mean_and_min() -> None:
    runs = [
        StartupRun(10.0, 10.5, {"model_resolve": 0.5, "model_load": 3.0}, 6.5),
        StartupRun(8.0, 8.25, {"model_resolve": 0.25, "model_load": 2.0}, 5.75),
    ]
    report = summarize(runs, ["--model", "/m"])
    assert report["time_to_health_s"] == {"mean": 9.0, "min": 8.0}
    assert report["time_to_first_token_s"] == {"mean": 9.375, "min": 8.25}
    assert report["after_phases_s"] == {"mean": 6.125, "min": 5.75}
    assert report["phases_s"] == {
        "model_resolve": {"mean": 0.375, "min": 0.25},
        "model_load": {"mean": 2.5, "min": 2.0},
    }
    assert report["runs"][1] == {
        "time_to_health_s": 8.0,
        "time_to_first_token_s": 8.25,
        "phases": {"model_resolve": 0.25, "model_load": 2.0},
        "after_phases_s": 5.75,
    }
    lines = report_lines(report)
    assert lines[1] == "  time to /health 200          9.00 s / 8.00 s"
    assert lines[4] == "    model_resolve             0.375 s / 0.250 s"
    assert lines[-1] == "    (after the phases)        6.125 s / 5.750 s"


def test_roofline_section_uses_the_flag_peaks() -> None:
    config = EngineConfig.create(
        device="cpu", dtype="float32", peak_flops=1e12, peak_bandwidth=1e10
    )
    meter = RooflineMeter(None)
    meter.phases["prefill"] = PhaseTotals(4, 2.0, 1e12, 1e9)  # 500 GFLOP/s, 0.5 GB/s
    meter.phases["decode"] = PhaseTotals(100, 5.0, 5e10, 2.5e10)  # 10 GFLOP/s, 5 GB/s
    section = roofline_section(SimpleNamespace(config=config, roofline=meter))  # type: ignore[arg-type]
    assert (section["peak_flops"], section["peak_bandwidth"]) == (1e12, 1e10)
    assert section["peaks_source"] == "flags"
    assert section["phases"]["prefill"]["pct_compute_roofline"] == 50.0
    assert section["phases"]["decode"]["pct_bandwidth_roofline"] == 50.0
    assert roofline_lines(section) == [
        "roofline (peaks 1000.0 GFLOP/s, 10.0 GB/s; flags):",
        "  prefill-heavy steps: 50.0% of compute roofline / 5.0% of bandwidth roofline"
        " (500.0 GFLOP/s, 0.5 GB/s, 4 steps in 2.00 s)",
        "   decode-heavy steps: 1.0% of compute roofline / 50.0% of bandwidth roofline"
        " (10.0 GFLOP/s, 5.0 GB/s, 100 steps in 5.00 s)",
    ]
