"""`kvflow bench throughput --compare transformers` on the tiny model: both engines run
the same prompts in one process and the report's numbers agree with each other."""

from __future__ import annotations

import json
import os
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
    read = report["roofline"]["weight_read"]  # the weights' own read pass, just after
    assert read["weight_bytes"] > 0 and read["read_gb_per_s"] > 0
    share = 100 * phases["decode"]["gb_per_s"] / read["read_gb_per_s"]
    assert read["pct_decode_of_read"] == pytest.approx(share, rel=0.05, abs=0.1)


FAKE_VLLM = """
import json, os, time
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens
class _Completion:
    def __init__(self, n): self.token_ids = list(range(n))
class _Output:
    def __init__(self, n): self.outputs = [_Completion(n)]
class LLM:
    def __init__(self, **kwargs):
        with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
            json.dump({"kwargs": kwargs, "env": os.environ.get("VLLM_TARGET_DEVICE")}, f)
    def generate(self, prompts, params, use_tqdm, lora_request=None):
        assert all(set(p) == {"prompt_token_ids"} for p in prompts)
        if lora_request is not None:  # the adapter directories exist while vLLM runs
            assert len(lora_request) == len(prompts)
            assert all(os.path.isdir(r.path) for r in lora_request)
            with open(os.environ["FAKE_VLLM_LOG"] + ".lora", "w") as f:
                json.dump([r.name for r in lora_request], f)
        time.sleep(0.2)  # a rate that a two-decimal ratio can show
        return [_Output(params.max_tokens) for _ in prompts]
"""


FAKE_LORA_REQUEST = """
class LoRARequest:
    def __init__(self, name, int_id, path):
        self.name, self.int_id, self.path = name, int_id, path
"""


def _fake_peer(tmp_path: Path) -> Path:
    """This interpreter with a stand-in `vllm` package on its path."""
    (tmp_path / "fake" / "vllm" / "lora").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (tmp_path / "fake" / "vllm" / "lora" / "__init__.py").write_text("")
    (tmp_path / "fake" / "vllm" / "lora" / "request.py").write_text(FAKE_LORA_REQUEST)
    peer = tmp_path / "peer-python"
    peer.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    peer.chmod(0o755)
    return peer


def test_throughput_compared_with_vllm_in_its_own_environment(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The peer runs in another interpreter (here: this one with a stand-in `vllm`
    package on its path), gets kvflow's model, dtype, limits and 8-bit KV cache, and its numbers land
    in the same report."""
    peer = _fake_peer(tmp_path)
    log = tmp_path / "vllm.json"
    command = [
        str(KVFLOW), "bench", "throughput", "--model", str(tiny_model_dir), *ENGINE_ARGS,
        "--num-prompts", "3", "--input-len", "16", "--output-len", "8", "--max-num-seqs", "4",
        "--kv-cache-dtype", "int8", "--compare", "vllm", "--peer-python", str(peer), "--json",
    ]  # fmt: skip
    env = {**os.environ, "FAKE_VLLM_LOG": str(log)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    peer_result = report["vllm 0.0-fake"]
    assert (peer_result["prompt_tokens"], peer_result["output_tokens"]) == (3 * 16, 3 * 8)
    asked = json.loads(log.read_text())
    assert asked["env"] == "cpu"
    assert asked["kwargs"]["model"] == str(tiny_model_dir)
    assert asked["kwargs"]["kv_cache_dtype"] == "fp8_e4m3"  # vLLM's 8-bit cache for int8
    assert asked["kwargs"]["load_format"] == "auto"  # kvflow's; "dummy" is passed on too
    assert (
        asked["kwargs"]["max_num_seqs"] == 4 and asked["kwargs"]["enable_prefix_caching"] is False
    )
    ratio = report["kvflow"]["output_tokens_per_s"] / peer_result["output_tokens_per_s"]
    assert report["speedup_output_tokens_per_s"] == pytest.approx(ratio, rel=2e-2, abs=0.01)


def test_compare_vllm_without_its_environment_says_where_it_looked(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    command = [
        str(KVFLOW), "bench", "throughput", "--model", str(tiny_model_dir), *ENGINE_ARGS,
        "--compare", "vllm", "--peer-python", str(missing),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"no interpreter at {missing}" in done.stderr


def test_lora_throughput_compared_with_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`--lora-adapters 2 --compare vllm`: vLLM gets the same adapter directories (alive
    while it runs), kvflow's rank and slots, runs them round-robin and then its base
    alone; the report has four runs and each server's adapted / base ratio."""
    peer, log = _fake_peer(tmp_path), tmp_path / "vllm.json"
    command = [
        str(KVFLOW), "bench", "throughput", "--model", str(tiny_model_dir), *ENGINE_ARGS,
        "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
        "--lora-adapters", "2", "--lora-adapter-rank", "4",
        "--compare", "vllm", "--peer-python", str(peer), "--json",
    ]  # fmt: skip
    env = {**os.environ, "FAKE_VLLM_LOG": str(log)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    runs = ["kvflow 2 LoRA", "kvflow base", "vllm 0.0-fake LoRA", "vllm 0.0-fake base"]
    for name in runs:
        assert report[name]["output_tokens"] == 3 * 4
    kwargs = json.loads(log.read_text())["kwargs"]
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (True, 4, 2)
    assert json.loads(Path(f"{log}.lora").read_text()) == ["adapter0", "adapter1", "adapter0"]
    rate = {name: report[name]["output_tokens_per_s"] for name in runs}
    lora = report["lora"]
    assert lora["vllm_lora_over_base"] == pytest.approx(rate[runs[2]] / rate[runs[3]], rel=5e-3)
    assert lora["kvflow_over_vllm_lora"] == pytest.approx(rate[runs[0]] / rate[runs[2]], rel=5e-3)
