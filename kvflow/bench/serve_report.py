"""What `kvflow bench serve` prints and saves, in vLLM's layout and key names, so that
scripts written for `vllm bench serve` output read kvflow's unchanged."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.bench.request_client import RequestOutput
from kvflow.bench.serve_metrics import BenchmarkMetrics, percentile_key

BACKEND = "openai"  # vLLM's name for a client of the OpenAI completions API
WIDTH = 50
HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(frozen=True)
class RunSetup:
    """The traffic settings of one run, as the summary and the result file name them."""

    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    date: str  # %Y%m%d-%H%M%S, shared by the JSON and its file name


def _line(label: str, value: float | int, decimals: bool = True) -> str:
    return f"{label:<40} {value:<10.2f}" if decimals else f"{label:<40} {value:<10}"


def format_summary(
    metrics: BenchmarkMetrics,
    setup: RunSetup,
    duration_s: float,
    metric_names: Sequence[str],
    with_goodput: bool,
) -> str:
    lines = [
        " Serving Benchmark Result ".center(WIDTH, "="),
        _line("Successful requests:", metrics.completed, decimals=False),
        _line("Failed requests:", metrics.failed, decimals=False),
    ]
    if setup.max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", setup.max_concurrency, False))
    if math.isfinite(setup.request_rate):
        lines.append(_line("Request rate configured (RPS):", setup.request_rate))
    lines += [
        _line("Benchmark duration (s):", duration_s),
        _line("Total input tokens:", metrics.total_input, decimals=False),
        _line("Total generated tokens:", metrics.total_output, decimals=False),
        _line("Request throughput (req/s):", metrics.request_throughput),
    ]
    if with_goodput:
        lines.append(_line("Request goodput (req/s):", metrics.request_goodput))
    lines += [
        _line("Output token throughput (tok/s):", metrics.output_throughput),
        _line("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s),
        _line("Peak concurrent requests:", metrics.max_concurrent_requests),
        _line("Total Token throughput (tok/s):", metrics.total_token_throughput),
    ]
    for name in metric_names:
        short, header = HEADERS[name]
        stats = metrics.stats[name]
        lines.append(header.center(WIDTH, "-"))
        lines.append(_line(f"Mean {short} (ms):", stats.mean))
        lines.append(_line(f"Median {short} (ms):", stats.median))
        for p, value in stats.percentiles:
            lines.append(_line(f"{percentile_key(p).upper()} {short} (ms):", value))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def result_json(
    metrics: BenchmarkMetrics,
    setup: RunSetup,
    outputs: Sequence[RequestOutput],
    duration_s: float,
    metric_names: Sequence[str],
    with_goodput: bool,
) -> dict[str, Any]:
    """vLLM's --save-result document (with its per-request lists always included)."""
    rate = setup.request_rate
    result: dict[str, Any] = {
        "date": setup.date,
        "backend": BACKEND,
        "model_id": setup.model_id,
        "tokenizer_id": setup.tokenizer_id,
        "num_prompts": setup.num_prompts,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": setup.burstiness,
        "max_concurrency": setup.max_concurrency,
        "duration": duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if with_goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": metrics.output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    for name in metric_names:
        stats = metrics.stats[name]
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles:
            result[f"{percentile_key(p)}_{name}_ms"] = value
    return result


def result_path(
    setup: RunSetup, result_dir: str | None, result_filename: str | None, sweep: bool
) -> Path:
    """vLLM's default name `openai-{rate}qps[-concurrency{c}]-{model}-{date}.json`; an
    explicit --result-filename gets `-{rate}qps` before its suffix in a rate sweep."""
    if result_filename is None:
        concurrency = f"-concurrency{setup.max_concurrency}" if setup.max_concurrency else ""
        base_model = setup.model_id.rstrip("/").split("/")[-1]
        name = f"{BACKEND}-{setup.request_rate}qps{concurrency}-{base_model}-{setup.date}.json"
    elif sweep:
        path = Path(result_filename)
        name = str(path.with_name(f"{path.stem}-{setup.request_rate}qps{path.suffix}"))
    else:
        name = result_filename
    return Path(result_dir) / name if result_dir else Path(name)
