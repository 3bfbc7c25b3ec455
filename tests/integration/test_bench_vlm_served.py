"""`kvflow bench vlm` end to end on a tiny LLaVA it writes itself: kvflow's server
starts, serves every image request, stops, and its figures are reported; with the vLLM
peer's environment on this machine, vLLM serves the same directory in the same run
(skipped where that environment is missing, as in CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.bench.vllm_compare import DEFAULT_PYTHON

pytestmark = pytest.mark.slow  # a real `kvflow serve` of a vision model (~4 processes)

KVFLOW = Path(sys.executable).with_name("kvflow")
TINY = [
    "--text-hidden", "64", "--text-layers", "2", "--vision-hidden", "32",
    "--vision-layers", "1", "--image-size", "28",
    "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
    "--max-concurrency", "2", "--num-warmups", "0", "--request-image-size", "40x30",
    "--max-model-len", "256", "--json",
]  # fmt: skip


def _bench(work: Path, *extra: str, timeout: float) -> dict[str, dict[str, float]]:
    command = [str(KVFLOW), "bench", "vlm", *TINY, "--work-dir", str(work), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_kvflow_serves_the_workload_and_reports_it(tmp_path: Path) -> None:
    report = _bench(tmp_path, "--dtype", "float32", timeout=600)
    ours = report["kvflow"]
    assert ours["completed"] == 3 and ours["output_tok_s"] > 0
    assert 0 < ours["ttft_p50_ms"] <= ours["ttft_p99_ms"]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == 64 and config["image_seq_length"] == 4
    result = json.loads((tmp_path / "kvflow.json").read_text())
    assert result["output_lens"] == [4, 4, 4]


def test_vllm_serves_the_same_directory(tmp_path: Path) -> None:
    python = Path(os.environ.get("KVFLOW_VLLM_PYTHON") or DEFAULT_PYTHON).expanduser()
    if not python.exists():
        pytest.skip(f"no vLLM environment at {python} (see /work/shared/peers/README.md)")
    # vLLM's CPU attention takes head sizes 32, 64, ...: the text model's is 64 here.
    report = _bench(tmp_path, "--compare", "vllm", timeout=1500)
    peer = next(value for name, value in report.items() if name.startswith("vllm"))
    assert peer["completed"] == 3 and peer["output_tok_s"] > 0
    assert report["output_tok_s_ratio"] > 0
    assert json.loads((tmp_path / "vllm.json").read_text())["output_lens"] == [4, 4, 4]
