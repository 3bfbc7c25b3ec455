"""`kvflow bench serve`'s server section: a kvflow server's step counters read from
/metrics before and after the timed part, and what its steps reached in between."""

from __future__ import annotations

import pytest

from kvflow.bench.serve_roofline import format_timed_part, parse_step_counters, timed_part


def _page(decode_steps: int, decode_s: float, decode_bytes: float, prefill_steps: int) -> str:
    """A /metrics page as kvflow's frontend writes it, two engines (data parallel)."""
    lines = []
    for engine in ("0", "1"):
        for name, phase, value in (
            ("engine_steps_total", "decode", decode_steps / 2),
            ("engine_step_seconds_total", "decode", decode_s / 2),
            ("estimated_flops_total", "decode", 1e9 * decode_steps / 2),
            ("estimated_bytes_total", "decode", decode_bytes / 2),
            ("engine_steps_total", "prefill", prefill_steps / 2),
            ("engine_step_seconds_total", "prefill", 1.0),
            ("estimated_flops_total", "prefill", 4e11),
            ("estimated_bytes_total", "prefill", 1e9),
        ):
            labels = f'model_name="m",engine="{engine}",phase="{phase}"'
            lines.append(f"kvflow:{name}{{{labels}}} {value}")
        labels = f'model_name="m",engine="{engine}"'
        lines.append(f"kvflow:device_peak_flops_per_second{{{labels}}} 4e11")
        lines.append(f"kvflow:device_peak_bytes_per_second{{{labels}}} 5e10")
    return "\n".join(lines) + "\n"


def test_the_timed_part_is_the_difference_of_two_readings() -> None:
    # Warm-up: 10 decode steps, 1 s, 20 GB; then the run adds 100 steps in 4 s that
    # move 160 GB: 40 GB/s, 80% of the 50 GB/s roof, 25 GFLOP/s of 400.
    before = parse_step_counters(_page(10, 1.0, 20e9, 2))
    after = parse_step_counters(_page(110, 5.0, 180e9, 6))
    assert before is not None and after is not None
    steps = timed_part(before, after)
    assert (steps["peak_flops"], steps["peak_bandwidth"]) == (4e11, 5e10)
    decode = steps["phases"]["decode"]
    assert decode["steps"] == 100 and decode["seconds"] == pytest.approx(4.0)
    assert decode["gb_per_s"] == pytest.approx(40.0)
    assert decode["pct_bandwidth_roofline"] == pytest.approx(80.0)
    assert decode["gflop_per_s"] == pytest.approx(25.0)
    assert decode["pct_compute_roofline"] == pytest.approx(6.25)
    # The prefill counters did not move in seconds: no row for a phase without time.
    assert "prefill" not in steps["phases"]
    text = format_timed_part(steps)
    assert "Server steps (timed part)" in text and "decode steps / seconds: 100 / 4.00" in text
    assert "of the bandwidth roof 80.0" in text


def test_a_server_without_kvflow_counters_has_no_section() -> None:
    vllm_page = 'vllm:num_requests_running{model_name="m"} 0.0\n'
    assert parse_step_counters(vllm_page) is None


def test_measure_weight_read_is_refused_where_it_would_do_nothing() -> None:
    from kvflow import LLM
    from kvflow.config import DeviceConfig
    from kvflow.errors import ConfigError

    with pytest.raises(ConfigError, match="device=cuda"):
        DeviceConfig(device="cuda", measure_weight_read=True)
    with pytest.raises(ConfigError, match="kvflow serve"):
        LLM(measure_weight_read=True)  # the offline engine exports no roofs
