"""`kvflow bench serve` against a real `kvflow serve` (tiny model, loopback), and
`kvflow bench latency` on the same model in-process: exit codes, vLLM's result keys,
and numbers that agree with each other and with what was asked."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import ENGINE_ARGS, MODEL_NAME, Server

pytestmark = pytest.mark.slow

KVFLOW = Path(sys.executable).with_name("kvflow")
RUN_TIMEOUT_S = 300.0
METRICS = ("ttft", "tpot", "itl", "e2el")
RESULT_KEYS = (
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
    "generated_texts", "errors",
)  # fmt: skip


def run_bench(name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVFLOW), "bench", name, *flags], capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def bench_serve(server: Server, result: Path, *flags: str) -> None:
    """Run with --save-result named `result` (a rate sweep adds -{rate}qps to the name)."""
    done = run_bench(
        "serve", "--base-url", server.base_url, "--disable-tqdm", "--save-result",
        "--result-dir", str(result.parent), "--result-filename", result.name, *flags,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "============ Serving Benchmark Result ============" in done.stdout


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def check_consistent(doc: dict[str, Any], num_prompts: int) -> None:
    """Everything completed, and the aggregates agree with the per-request lists."""
    assert doc["completed"] == num_prompts and doc["errors"] == [""] * num_prompts
    assert doc["total_input_tokens"] == sum(doc["input_lens"])
    assert doc["total_output_tokens"] == sum(doc["output_lens"])
    duration = doc["duration"]
    assert doc["request_throughput"] * duration == pytest.approx(num_prompts)
    assert doc["output_throughput"] * duration == pytest.approx(doc["total_output_tokens"])
    for ttft, itl, out_len in zip(doc["ttfts"], doc["itls"], doc["output_lens"]):
        assert 0 < ttft < duration
        assert ttft + sum(itl) <= duration  # e2el = ttft + the chunk gaps
        assert len(itl) <= out_len - 1  # one gap per chunk; a chunk holds >= 1 token


def test_random_ignore_eos(server: Server, tiny_model_dir: Path, tmp_path: Path) -> None:
    bench_serve(
        server, tmp_path / "random.json",
        "--num-prompts", "8", "--random-input-len", "24", "--random-output-len", "6",
        "--ignore-eos", "--percentile-metrics", ",".join(METRICS),
        "--metric-percentiles", "50,99", "--goodput", "e2el:600000", "ttft:600000",
        "--num-warmups", "3",
    )  # fmt: skip
    doc = load(tmp_path / "random.json")
    # The server's own steps over the timed part (the readings' difference: unit-tested
    # in test_serve_roofline.py): 8 prompts of 24 tokens, 5 decoded tokens each.
    steps = doc["server_steps"]
    assert steps["peak_flops"] > 0 and steps["peak_bandwidth"] > 0
    decode, prefill = steps["phases"]["decode"], steps["phases"]["prefill"]
    assert 5 <= decode["steps"] <= 8 * 5 and 1 <= prefill["steps"] <= 8
    assert decode["gb_per_s"] > 0 and decode["pct_bandwidth_roofline"] > 0
    for key in RESULT_KEYS:
        assert key in doc, key
    assert (doc["model_id"], doc["tokenizer_id"]) == (MODEL_NAME, str(tiny_model_dir))
    assert (doc["num_prompts"], doc["request_rate"], doc["max_concurrency"]) == (8, "inf", None)
    check_consistent(doc, 8)
    assert doc["input_lens"] == [24] * 8  # token-id prompts: exact lengths
    assert doc["output_lens"] == [6] * 8 and doc["total_output_tokens"] == 48
    for name in METRICS:
        mean, median = doc[f"mean_{name}_ms"], doc[f"median_{name}_ms"]
        assert 0 < median <= doc[f"p99_{name}_ms"] and doc[f"p50_{name}_ms"] == median
        assert mean > 0 and doc[f"std_{name}_ms"] >= 0
    assert doc["mean_ttft_ms"] < doc["mean_e2el_ms"]
    assert doc["p99_ttft_ms"] <= doc["p99_e2el_ms"]
    # e2el = ttft + 5 gaps; TPOT spreads those over the same 5 tokens
    assert doc["mean_tpot_ms"] * 5 == pytest.approx(doc["mean_e2el_ms"] - doc["mean_ttft_ms"])
    assert doc["request_goodput"] == pytest.approx(doc["request_throughput"])  # all within


def test_rate_sweep_prefix_repetition(server: Server, tmp_path: Path) -> None:
    plotting = importlib.util.find_spec("matplotlib") is not None
    flags = [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "16",
        "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
        "--prefix-repetition-output-len", "4", "--num-prompts", "6", "--ignore-eos",
        "--request-rate", "10,inf", "--max-concurrency", "2",
    ]  # fmt: skip
    if plotting:
        flags += ["--plot", str(tmp_path / "curves.png")]
    bench_serve(server, tmp_path / "sweep.json", *flags)
    for rate, name in [(10.0, "sweep-10.0qps.json"), ("inf", "sweep-infqps.json")]:
        doc = load(tmp_path / name)
        assert (doc["request_rate"], doc["max_concurrency"]) == (rate, 2)
        check_consistent(doc, 6)
        assert doc["input_lens"] == [24] * 6 and doc["total_output_tokens"] == 24
    if plotting:
        assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_sharegpt_file(server: Server, tmp_path: Path) -> None:
    prompts = [
        f"Tell me a story about dragon number {i} and the knight who met it." for i in range(3)
    ]
    conversations = [
        {"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "Once."}]}
        for p in prompts
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    bench_serve(
        server, tmp_path / "sharegpt-result.json",
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--num-prompts", "3",
        "--sharegpt-output-len", "5", "--ignore-eos", "--request-rate", "20",
    )  # fmt: skip
    doc = load(tmp_path / "sharegpt-result.json")
    check_consistent(doc, 3)
    assert doc["total_output_tokens"] == 15
    # the client counts prompt tokens as the server does
    counts = [
        httpx.post(f"{server.base_url}/tokenize", json={"prompt": p}, timeout=10).json()["count"]
        for p in prompts
    ]
    assert sorted(doc["input_lens"]) == sorted(counts)


def test_unknown_model_fails_fast(server: Server, tiny_model_dir: Path) -> None:
    done = run_bench(
        "serve", "--base-url", server.base_url, "--model", "no-such-model",
        "--tokenizer", str(tiny_model_dir), "--num-prompts", "2", "--disable-tqdm",
    )  # fmt: skip
    assert done.returncode != 0
    assert "initial test request failed: HTTP 404" in done.stderr


def test_bench_latency(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = [*ENGINE_ARGS, "--num-blocks", "64"]  # the last value wins: a small cache
    out = tmp_path / "latency.json"
    done = run_bench(
        "latency", "--model", str(tiny_model_dir), *engine, "--batch-size", "2",
        "--input-len", "8", "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "3",
        "--output-json", str(out), "--disable-tqdm",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert len(doc["latencies"]) == 3 and all(t > 0 for t in doc["latencies"])
    assert doc["avg_latency"] == pytest.approx(sum(doc["latencies"]) / 3)
    assert list(doc["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(doc["latencies"]) <= doc["percentiles"]["50"] <= max(doc["latencies"])
    assert f"Avg latency: {doc['avg_latency']} seconds" in done.stdout
