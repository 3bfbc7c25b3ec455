"""README's engine options through the real engine (`kvflow.LLM`, in this process), each
by an effect a user can see: `dtype=auto`, `max_model_len`, `kv_cache_memory`,
`num_threads` and `policy=priority`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.errors import ConfigError, PromptTooLongError
from kvflow.metrics import dtype_choice
from kvflow.metrics.dtype_choice import DTypeChoice, faster_dtype

pytestmark = pytest.mark.slow  # each test loads an engine or two (1-4 s here)

BASE: dict[str, Any] = {"dtype": "float32", "device": "cpu"}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("measured", ["float32", "bfloat16"])
def test_dtype_auto_takes_the_measured_dtype_and_generates(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured: str
) -> None:
    # README: "on CPU the dtype whose matmuls this machine runs faster, measured once".
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    fp32, bf16 = (100.0, 500.0) if measured == "bfloat16" else (200.0, 150.0)
    fake = DTypeChoice(faster_dtype(fp32, bf16), fp32, bf16, "measured")
    monkeypatch.setattr(dtype_choice, "measure_cpu_dtype", lambda threads=None: fake)
    llm = LLM(str(tiny_model_dir), dtype="auto", device="cpu", num_blocks=32)
    expected = getattr(torch, measured)
    engine = llm.engine
    assert engine.config.model.dtype == measured
    assert {p.dtype for p in engine.runner.model.parameters()} == {expected}
    assert engine.runner.kv_spec.dtype == expected
    # Which tokens depends on the dtype, so on the machine: only lengths are asserted.
    output = llm.generate(["The capital of France is"], GREEDY)[0].outputs[0]
    assert len(output.token_ids) == 4 and output.finish_reason == "length"
    assert json.loads((tmp_path / "dtype_choice.json").read_text())  # the next start reads it


def test_max_model_len_caps_the_context(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), **BASE, num_blocks=32, max_model_len=64)  # the model's: 512
    assert llm.engine.max_model_len == 64
    assert len(llm.generate([[5] * 60], GREEDY)[0].outputs[0].token_ids) == 4
    with pytest.raises(PromptTooLongError, match="64"):
        llm.generate([[5] * 61], GREEDY)  # 61 + 4 > 64
    with pytest.raises(ConfigError, match="exceeds the model's context 512"):
        LLM(str(tiny_model_dir), **BASE, num_blocks=32, max_model_len=1024)


def _bytes_per_block(model_dir: Path, block_size: int = 16) -> int:
    """K and V, every layer, float32: from config.json, not from kvflow's own code."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return per_token * block_size


def test_kv_cache_memory_sets_the_number_of_blocks(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    per_block = _bytes_per_block(tiny_model_dir)
    for gib in (0.001, 0.002):
        with caplog.at_level(logging.INFO, logger="kvflow.offline.engine"):
            llm = LLM(str(tiny_model_dir), **BASE, kv_cache_memory=gib)
        expected = int(gib * (1 << 30) // per_block)
        assert llm.engine.runner.num_blocks == expected
        assert f"engine ready: {expected} KV blocks of 16 tokens" in caplog.text
    # A cache of 13 blocks holds 208 tokens: a request needing more is refused up front
    # (it would otherwise be preempted forever), though the context (512) allows it.
    small = LLM(str(tiny_model_dir), **BASE, kv_cache_memory=13.5 * per_block / (1 << 30))
    assert small.engine.runner.num_blocks == 13
    assert len(small.generate([[5] * 200], GREEDY)[0].outputs[0].token_ids) == 4
    with pytest.raises(PromptTooLongError, match="raise kv_cache_memory"):
        small.generate([[5] * 300], GREEDY)


def test_num_threads_sets_torch_threads(tiny_model_dir: Path) -> None:
    before = torch.get_num_threads()
    try:
        target = 1 if before != 1 else 2
        llm = LLM(str(tiny_model_dir), **BASE, num_blocks=32, num_threads=target)
        assert torch.get_num_threads() == target  # the engine's worker is this process
        assert len(llm.generate(["Hi"], GREEDY)[0].outputs[0].token_ids) == 4
    finally:
        torch.set_num_threads(before)  # the rest of the session keeps its threads


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["a", "b", "c", "d"]), ("priority", ["d", "b", "c", "a"])]
)
def test_policy_orders_admission(tiny_model_dir: Path, policy: str, order: list[str]) -> None:
    """One request runs at a time (max_num_seqs=1), so requests finish in the order the
    scheduler admits them: arrival under fcfs, lowest priority value first under
    priority (vLLM's convention; ties by arrival)."""
    llm = LLM(str(tiny_model_dir), **BASE, num_blocks=32, max_num_seqs=1, policy=policy)
    engine = llm.engine
    for request_id, priority in (("a", 3), ("b", 1), ("c", 1), ("d", 0)):
        engine.add_request(request_id, "Hello", GREEDY, priority=priority)
    finished = []
    while engine.has_unfinished_requests():
        finished += [output.request_id for output in engine.step() if output.finished]
    assert finished == order


def test_pipeline_parallel_with_speculative_decoding_is_refused_not_ignored(
    tiny_model_dir: Path,
) -> None:
    # Pipeline parallelism runs (tests/e2e/test_pipeline_parallel_offline.py); drafts
    # across stages are not built.
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="speculative decoding"):
        LLM(
            str(tiny_model_dir),
            **BASE,
            num_blocks=32,
            pipeline_parallel_size=2,
            speculative_config=spec,
        )
