"""`kvflow serve --trace-file`: after a clean SIGTERM the trace is valid Chrome trace
JSON whose steps account for every computed token, and agrees with the roofline and
start-up metrics the frontend exports."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import MODEL_NAME, start_server, stop_server

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Once upon a time in a land", "Numbers: 1, 2, 3"]
MAX_TOKENS = 6
SETTLE_TIMEOUT_S = 60.0  # a deadline only: a loaded 2-core machine may lag seconds
WORKER_PHASES = {"tokenizer_load", "model_load", "kv_cache_profile", "kv_cache_allocate"}


def metric_totals(base_url: str) -> dict[str, float]:
    """Each family's samples summed over labels, plus startup phases by name."""
    totals: dict[str, float] = {}
    text = httpx.get(base_url + "/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "kvflow:startup_phase_seconds":
                totals[f"phase:{sample.labels['phase']}"] = sample.value
            else:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def settled_metrics(base_url: str, num_requests: int) -> dict[str, float]:
    """Metrics once a stats message (every 0.5 s) counts every request's tokens and no
    request left: the scheduler counts a step's tokens, steps, roofline and trace event
    together, so that message holds the final totals and no step can follow it."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        totals = metric_totals(base_url)
        generated = totals.get("kvflow:generation_tokens_total", 0.0)
        idle = totals.get("kvflow:num_requests_running", -1.0) == 0
        idle = idle and totals.get("kvflow:num_requests_waiting", -1.0) == 0
        if generated >= num_requests * MAX_TOKENS and idle:
            return totals
        assert time.monotonic() < deadline, f"stats never settled: {generated=}, {idle=}"
        time.sleep(0.1)


def complete(base_url: str, prompt: str) -> Any:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=60.0)
    response.raise_for_status()
    return response.json()["usage"]


def test_trace_file_after_sigterm(tiny_model_dir: Path, tmp_path: Path) -> None:
    trace_path = tmp_path / "steps.json"
    server = start_server(tiny_model_dir, tmp_path, "--trace-file", str(trace_path))
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            usages = list(pool.map(lambda p: complete(server.base_url, p), PROMPTS))
        metrics = settled_metrics(server.base_url, len(PROMPTS))
    finally:
        code, survivors = stop_server(server)
    assert code == 0 and survivors == [], server.log_tail()

    events = json.loads(trace_path.read_text())  # valid JSON: closed at shutdown
    assert {(e["ph"], e["name"]) for e in events if e["ph"] == "M"} == {
        ("M", "process_name"),
        ("M", "thread_name"),
    }
    steps = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in steps} == {"prefill step", "decode step"}
    assert all(e["dur"] > 0 for e in steps)
    assert [e["ts"] for e in steps] == sorted(e["ts"] for e in steps)
    # Distinct prompts (no prefix-cache hits): every prompt token is prefilled once, and
    # every output token but the last is fed back once.
    assert sum(e["args"]["prefill_tokens"] for e in steps) == sum(
        u["prompt_tokens"] for u in usages
    )
    assert sum(e["args"]["decode_tokens"] for e in steps) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert sum(e["args"]["num_logits"] for e in steps) == len(PROMPTS) * MAX_TOKENS
    assert all(e["args"]["preemptions"] == 0 for e in steps)
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"tokens", "requests", "kv_cache_usage_perc", "preemptions"}

    # The frontend's counters describe the same steps.
    assert metrics["kvflow:engine_steps_total"] == len(steps)
    flops = sum(e["args"]["est_flops"] for e in steps)
    assert metrics["kvflow:estimated_flops_total"] == pytest.approx(flops, rel=1e-9)
    assert flops > 0
    traced_bytes = sum(e["args"]["est_bytes"] for e in steps)
    assert metrics["kvflow:estimated_bytes_total"] == pytest.approx(traced_bytes, rel=1e-9)
    assert metrics["kvflow:device_peak_flops_per_second"] > 0
    assert metrics["kvflow:device_peak_bytes_per_second"] > 0
    assert {f"phase:{p}" for p in WORKER_PHASES | {"model_resolve"}} <= set(metrics)
    assert metrics["phase:model_load"] > 0


def test_measure_weight_read_sets_the_bandwidth_roof(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The worker's own read pass over its weights replaces the --peak-bandwidth flag
    # (1 byte/s here, far below any DRAM) and is a start-up phase of its own.
    flags = ["--peak-flops", "1e12", "--peak-bandwidth", "1", "--measure-weight-read"]
    server = start_server(tiny_model_dir, tmp_path, *flags)
    try:
        complete(server.base_url, PROMPTS[0])
        metrics = settled_metrics(server.base_url, 1)
    finally:
        code, survivors = stop_server(server)
    assert code == 0 and survivors == [], server.log_tail()
    assert metrics["kvflow:device_peak_flops_per_second"] == 1e12
    assert metrics["kvflow:device_peak_bytes_per_second"] > 1e8  # > 0.1 GB/s: a real pass
    assert metrics["phase:weight_read_pass"] > 0
