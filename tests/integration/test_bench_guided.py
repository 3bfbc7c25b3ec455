"""`kvflow bench guided`: plain vs JSON-schema decoding on the same prompts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from serve_harness import KVFLOW


def test_guided_bench_reports_both_rates(tiny_model_dir: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.json"
    schemas = [{"type": "integer"}, {"type": "string", "maxLength": 4}, {"type": "nonsense"}]
    corpus.write_text(json.dumps([{"name": str(i), "schema": s} for i, s in enumerate(schemas)]))
    command = [str(KVFLOW), "bench", "guided", "--model", str(tiny_model_dir)]
    command += ["--compile-corpus", str(corpus)]
    command += ["--dtype", "float32", "--device", "cpu", "--num-blocks", "64"]
    command += ["--batch-sizes", "1", "3", "--output-len", "12", "--repeats", "1", "--json"]
    command += ["--goals", "--goals-batch", "3", "--goals-max-tokens", "16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["compile"]["first_s"] > report["compile"]["cached_s"] >= 0
    compiled = report["corpus"]
    assert (compiled["schemas"], compiled["refused"]) == (2, 1)  # "nonsense" is no type
    assert 0 < compiled["p50_ms"] <= compiled["p99_ms"] <= compiled["max_ms"]
    assert [row["batch"] for row in report["batches"]] == [1, 3]
    for row in report["batches"]:
        assert row["plain_tok_s"] > 0 and row["guided_tok_s"] > 0
        ratio = row["guided_tok_s"] / row["plain_tok_s"]  # the rates are rounded to 0.1
        assert abs(row["guided_over_plain"] - ratio) < 0.01 + 0.1 / row["plain_tok_s"]
        cpu_ratio = row["guided_tok_cpu_s"] / row["plain_tok_cpu_s"]  # per CPU second
        assert abs(row["guided_over_plain_cpu"] - cpu_ratio) < 0.01 + 0.1 / row["plain_tok_cpu_s"]
        assert row["plain_tok_cpu_s"] > 0 and row["guided_tok_cpu_s"] > 0
    goals = report["goals"]
    assert goals["valid"]["requests"] == 3
    assert goals["valid"]["valid"] + goals["valid"]["cut_by_max_tokens"] <= 3
    assert goals["cached_ttft"]["plain_ms"] > 0 and goals["cached_ttft"]["guided_cached_ms"] > 0
    jump = goals["jump_forward"]
    assert jump["identical"] and 0 <= jump["tokens_jumped"] <= jump["output_tokens"]
    assert jump["steps_on"] <= jump["steps_off"]
