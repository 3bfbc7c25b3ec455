"""Speculative verification steps replay CPU decode graphs (one decode row per query
token: gpu_worker/token_decodes.py) and keep greedy outputs token-identical to decoding
without speculation, on a plain and a hybrid (sliding-window) KV cache, in float32 and
bfloat16; with the torch attention backend there are no graphs and the verification
runs eagerly, with the same tokens. The drafts come from the target as its own draft
model (every one accepted: a tiny random model's output rarely repeats, so n-grams
seldom match); the n-gram and suffix methods replay graphs on the embedded model in
tests/e2e/test_spec_decode_engine.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.gpu_worker.cpu_graphs import CpuDecodeGraphs
from kvflow.kernels.cpu.paged_decode import load_paged_decode

pytestmark = pytest.mark.native(load_paged_decode() is not None)

PROMPTS = ["1 2 3 1 2 3 1 2 3 1 2", "a b a b a b a b", "the cat the cat the cat the"]
MAX_TOKENS = [12, 17, 9]  # batches shrink as requests finish


def _generate(model_dir: Path, spec: dict[str, Any] | None, **options: Any) -> tuple[Any, LLM]:
    llm = LLM(
        str(model_dir), num_threads=1, block_size=4, num_blocks=96, speculative_config=spec,
        **options,
    )  # fmt: skip
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)], llm


def _self_draft(model_dir: Path) -> dict[str, Any]:
    return {"method": "draft_model", "num_speculative_tokens": 3, "model": str(model_dir)}


@pytest.mark.parametrize(
    ("model", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("gemma3", "float32")]
)
def test_verification_replays_graphs_with_spec_off_tokens(
    tiny_model_dir: Callable[[str], Path], model: str, dtype: str
) -> None:
    model_dir = tiny_model_dir(model)
    plain, _ = _generate(model_dir, None, dtype=dtype, enforce_eager=True)
    tokens, llm = _generate(model_dir, _self_draft(model_dir), dtype=dtype)
    assert tokens == plain
    counters = llm.engine.scheduler.speculator.counters  # type: ignore[union-attr]
    assert counters.num_accepted_tokens > 0.9 * counters.num_draft_tokens > 0
    graphs = llm.engine.runner.decode_graphs
    assert isinstance(graphs, CpuDecodeGraphs)
    assert graphs.num_verify_replays > 0 and not graphs.refused


def test_torch_backend_verifies_eagerly_with_the_same_tokens(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    model_dir = tiny_model_dir("llama")
    plain, _ = _generate(model_dir, None, dtype="float32", enforce_eager=True)
    spec = _self_draft(model_dir)
    tokens, llm = _generate(model_dir, spec, dtype="float32", attention_backend="torch")
    assert tokens == plain
    assert llm.engine.runner.decode_graphs is None


@pytest.mark.parametrize("k", [2, 5])
def test_the_spec_bench_records_every_verification_size_before_timing(
    tiny_model_dir: Callable[[str], Path], k: int
) -> None:
    # Otherwise the timed prompts pay a recording per draft length they happen to reach.
    from kvflow.bench import spec_decode
    from kvflow.cli.main import build_parser

    argv = ["bench", "spec-decode", "--model", str(tiny_model_dir("llama")), "--dataset"]
    args = build_parser().parse_args([*argv, "random", "--num-threads", "1"])
    spec_decode.apply_shape_args(args)
    config = spec_decode._load("ngram", {"method": "ngram", "num_speculative_tokens": k}, args)
    graphs = config.llm.engine.runner.decode_graphs
    assert isinstance(graphs, CpuDecodeGraphs)
    assert sorted(n for n, _ in graphs.tapes) == list(range(1, k + 2))
    speculator = config.llm.engine.scheduler.speculator
    assert type(speculator.proposer).__name__ == "NgramProposer"  # the real one is back
