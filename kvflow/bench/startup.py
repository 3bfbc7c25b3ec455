"""`kvflow bench startup`: how long `kvflow serve` takes to come up and answer.

Each iteration launches `kvflow serve` (the engine flags given here, passed through) as a
subprocess on a free 127.0.0.1 port and measures, from the launch:

    time_to_health_s       until GET /health answers 200 (the engine is ready)
    time_to_first_token_s  until the first streamed chunk of one completion arrives

then reads the server's own phase timings from /metrics
(`kvflow:startup_phase_seconds{phase=...}`: model_resolve, model_load, kv_cache_allocate,
...; see kvflow/metrics/startup_phases.py) and stops the server with SIGTERM. The phases run one
after another (launcher, then worker); `after_phases_s` is the rest of the time to
health: the scheduler's ack, the frontend's start and its first engine stats. With
--num-iters N the report gives the mean and the min of each number.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

POLL_S = 0.02
STOP_TIMEOUT_S = 30.0


@dataclass
class StartupRun:
    time_to_health_s: float
    time_to_first_token_s: float
    phases: dict[str, float]
    after_phases_s: float  # time_to_health_s - the phases' sum


def add_args(parser: argparse.ArgumentParser) -> None:
    """Bench flags only; the caller adds the engine flags (passed on to `kvflow serve`)."""
    parser.add_argument("--num-iters", type=int, default=1, help="server launches to time")
    parser.add_argument("--prompt", default="Hello, my name is", help="the completion's prompt")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--output-json", default=None, help="also write the JSON report here")


def serve_flags(options: dict[str, Any]) -> list[str]:
    """Engine options back into `kvflow serve` flags (`block_size=32` -> --block-size 32)."""
    flags: list[str] = []
    for name, value in options.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def run(args: argparse.Namespace) -> int:
    from kvflow.cli.args import engine_options

    flags = serve_flags(engine_options(args))
    runs = [launch_once(flags, args.prompt, args.timeout) for _ in range(args.num_iters)]
    report = summarize(runs, flags)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    print(json.dumps(report) if args.json else "\n".join(report_lines(report)))
    return 0


def launch_once(flags: list[str], prompt: str, timeout_s: float) -> StartupRun:
    """One launch, measured; the server is stopped (its whole process group) after."""
    port = _free_port()
    command = [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port)]
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+b", prefix="kvflow-bench-startup-", suffix=".log") as log:
        start = time.perf_counter()
        process = subprocess.Popen(
            [*command, *flags], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            with httpx.Client(base_url=base_url, timeout=timeout_s) as http:
                health_s = _wait_healthy(http, process, start + timeout_s, log) - start
                first_token_s = _first_token(http, prompt) - start
                phases = _startup_phases(http.get("/metrics").text)
        finally:
            _stop(process)
    rest = round(health_s - sum(phases.values()), 4)
    return StartupRun(round(health_s, 4), round(first_token_s, 4), phases, rest)


def _wait_healthy(
    http: httpx.Client, process: subprocess.Popen[bytes], deadline: float, log: Any
) -> float:
    """perf_counter() at the first 200 from /health."""
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-4000:]
            raise SystemExit(f"kvflow serve exited with {process.returncode}:\n{tail}")
        try:
            if http.get("/health", timeout=2.0).status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(POLL_S)
    raise SystemExit("kvflow bench startup: the server did not become healthy in time")


def _first_token(http: httpx.Client, prompt: str) -> float:
    """perf_counter() at the first streamed chunk of a short completion."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter()
    raise SystemExit("kvflow bench startup: the completion streamed no token")


def _startup_phases(metrics_text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.labels["phase"]: sample.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "kvflow:startup_phase_seconds"
        for sample in family.samples
    }


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the server's group only
        process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def summarize(runs: list[StartupRun], flags: list[str]) -> dict[str, Any]:
    """Mean and min of each number over the runs, and the runs themselves."""

    def spread(values: list[float]) -> dict[str, float]:
        return {"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4)}

    phase_names = [name for name in runs[0].phases]
    return {
        "num_iters": len(runs),
        "serve_flags": flags,
        "time_to_health_s": spread([r.time_to_health_s for r in runs]),
        "time_to_first_token_s": spread([r.time_to_first_token_s for r in runs]),
        "after_phases_s": spread([r.after_phases_s for r in runs]),
        "phases_s": {
            name: spread([r.phases[name] for r in runs if name in r.phases]) for name in phase_names
        },
        "runs": [vars(r) for r in runs],
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"kvflow serve start-up over {report['num_iters']} launch(es): mean / min"]
    for key, label in (
        ("time_to_health_s", "time to /health 200"),
        ("time_to_first_token_s", "time to first token"),
    ):
        lines.append(f"  {label:<24} {report[key]['mean']:8.2f} s / {report[key]['min']:.2f} s")
    lines.append("  server-side phases, in order:")
    for name, values in report["phases_s"].items():
        lines.append(f"    {name:<22} {values['mean']:8.3f} s / {values['min']:.3f} s")
    rest = report["after_phases_s"]
    lines.append(f"    {'(after the phases)':<22} {rest['mean']:8.3f} s / {rest['min']:.3f} s")
    return lines
