"""`kvflow bench throughput --compare transformers` on the tiny model: both engines run
the same prompts in one process and the report's numbers agree with each other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serve_harness import ENGINE_ARGS

pytestmark = pytest.mark.slow

KVFLOW = Path(sys.executable).with_name("kvflow")


def test_throughput_compared_with_transformers(tiny_model_dir: Path) -> None:
    command = [
        str(KVFLOW), "bench", "throughput", "--model", str(tiny_model_dir), *ENGINE_ARGS,
        "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
        "--compare", "transformers", "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    kvflow, transformers = report["kvflow"], report["transformers"]
    for result in (kvflow, transformers):  # ignore_eos: every request gets all its tokens
        assert result["num_requests"] == 4
        assert (result["prompt_tokens"], result["output_tokens"]) == (4 * 16, 4 * 8)
        assert result["elapsed_s"] > 0
        assert result["output_tokens_per_s"] == pytest.approx(32 / result["elapsed_s"], rel=1e-2)
    ratio = kvflow["output_tokens_per_s"] / transformers["output_tokens_per_s"]
    assert report["speedup_output_tokens_per_s"] == pytest.approx(ratio, rel=2e-2)
    # The 4 prompts (64 tokens) are prefilled in one step, then each of the 7 other
    # output tokens of the 4 requests is one decode step of 4 tokens.
    phases = report["roofline"]["phases"]
    assert {phase: row["steps"] for phase, row in phases.items()} == {"prefill": 1, "decode": 7}
    for row in phases.values():
        assert row["seconds"] > 0 and row["gflop_per_s"] > 0 and row["gb_per_s"] > 0
