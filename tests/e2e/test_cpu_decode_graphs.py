"""CPU decode graphs (gpu_worker/cpu_graphs.py) change nothing but the step's host time:
greedy tokens equal an `enforce_eager` engine's to the bit, while batches shrink and
grow, contexts cross block boundaries, the memory budget evicts graphs, and the cache
is quantized."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.gpu_worker.cpu_graphs import CpuDecodeGraphs
from kvflow.kernels.cpu.paged_decode import load_paged_decode

pytestmark = [pytest.mark.native(load_paged_decode() is not None), pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
    "Water boils at",
]
# Different lengths: the decode batch goes 5, 4, 3, 2, 1 as requests finish.
MAX_TOKENS = [9, 14, 20, 27, 33]


def _generate(
    model_dir: Path, prompts: list[Any], rounds: int = 1, **options: Any
) -> tuple[list[list[int]], Any]:
    llm = LLM(str(model_dir), num_threads=1, block_size=4, **options)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    tokens = []
    for _ in range(rounds):
        outputs = llm.generate(prompts[: len(MAX_TOKENS)], params)
        tokens += [o.token_ids for o in outputs]
    return tokens, llm.engine.runner.decode_graphs


def _check_same_as_eager(model_dir: Path, rounds: int = 1, **options: Any) -> CpuDecodeGraphs:
    eager, none = _generate(model_dir, PROMPTS, rounds, enforce_eager=True, **options)
    assert none is None
    replayed, graphs = _generate(model_dir, PROMPTS, rounds, **options)
    assert isinstance(graphs, CpuDecodeGraphs)
    assert replayed == eager
    return graphs


@pytest.mark.parametrize(
    "options",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16"},
        {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
        {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"},
    ],
    ids=["float32", "bfloat16", "bfloat16-int8-kv", "float32-fp8-kv"],
)
def test_replays_give_the_eager_tokens(tiny_model_dir: Any, options: dict[str, Any]) -> None:
    graphs = _check_same_as_eager(tiny_model_dir("llama"), **options)
    # every batch size of the run was recorded once, and every other decode step replayed
    assert graphs.num_recordings == len(MAX_TOKENS)
    assert graphs.num_replays + graphs.num_recordings >= max(MAX_TOKENS) - 2
    assert not graphs.refused


def test_an_evicted_size_is_recorded_again(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget of one graph: each new size evicts the last, so the second round
    records every size again, and all stays exact."""
    monkeypatch.setattr("kvflow.gpu_worker.cpu_graphs.DEFAULT_MEMORY_BUDGET", 1)
    graphs = _check_same_as_eager(tiny_model_dir("qwen2"), rounds=2, dtype="float32")
    assert len(graphs.tapes) == 1
    assert graphs.num_recordings == 2 * len(MAX_TOKENS)


def test_the_embedded_model_matches_eager_over_a_long_decode(embedded_model_dir: Path) -> None:
    """The real model (GGUF blocks at one row, the bf16 GEMM at more): a longer run."""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9] * 20, [10, 11], [12] * 7]
    eager, _ = _generate(embedded_model_dir, prompts, 1, enforce_eager=True, dtype="bfloat16")
    replayed, graphs = _generate(embedded_model_dir, prompts, 1, dtype="bfloat16")
    assert replayed == eager
    assert graphs.num_replays > 0


def test_a_hybrid_kv_cache_replays_every_groups_tables(tiny_model_dir: Any) -> None:
    """Gemma 3 (a local and a global layer, window 8): two block tables per request, the
    local one releasing blocks as contexts pass the window; each replay reads both."""
    graphs = _check_same_as_eager(tiny_model_dir("gemma3"), dtype="float32")
    assert len(graphs.static.group_tables) == 1
    assert graphs.num_replays > 0 and not graphs.refused
