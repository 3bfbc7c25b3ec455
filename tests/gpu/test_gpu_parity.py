"""Greedy parity on a GPU: the CUDA engine (Triton attention, decode CUDA graphs, chunked
prefill) gives the CPU engine's tokens on the embedded model and on a tiny random model of
every supported family. Both run in float32.

Two fp32 engines sum in different orders, so where the top two logits are closer than
that noise either token is right: the outputs must agree up to a position where the CPU
engine's top-2 gap is below TIE_GAP, and on every agreed token the two logprobs must
match to LOGPROB_ATOL. Run by tests/gpu/run_gpu_checks.sh; skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.gpu_worker.models.registry import MODEL_CLASSES
from kvflow.outputs import CompletionOutput

pytestmark = pytest.mark.cuda

FAMILIES = [
    name.removesuffix("ForCausalLM").lower()
    for name in sorted(MODEL_CLASSES)
    if name.endswith("ForCausalLM")  # text models; LLaVA: tests/kernels/test_engine_triton.py
]
TIE_GAP = 0.02  # nats
LOGPROB_ATOL = 0.02
# 8 prompts (token ids): short and long, one past the step budget (chunked prefill), two
# sharing a 32-token prefix (prefix cache), ragged so decode batches mix with prefills.
_SHARED = list(range(500, 532))
PROMPTS = [
    [1, 2, 3],
    list(range(100, 121)),
    list(range(1000, 1150)),
    [*_SHARED, 7, 8, 9],
    [*_SHARED, 10, 11],
    [42] * 17,
    list(range(3000, 3064, 2)),
    list(range(20000, 20090)),
]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
OPTIONS: dict[str, Any] = dict(
    dtype="float32", block_size=16, max_num_batched_tokens=128, num_blocks=512
)


def _generate(model: str, device: str) -> list[CompletionOutput]:
    llm = LLM(model, device=device, **OPTIONS)
    try:
        return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.close()


def _top2_gap(step: dict[int, Any]) -> float:
    best = sorted((lp.logprob for lp in step.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def assert_greedy_parity(cuda: list[CompletionOutput], cpu: list[CompletionOutput]) -> None:
    """Same tokens up to a near-tie of the CPU engine; same logprobs where they agree."""
    assert len(cuda) == len(cpu) == len(PROMPTS)
    for i, (got, want) in enumerate(zip(cuda, cpu)):
        assert got.logprobs is not None and want.logprobs is not None
        agreed = 0
        while agreed < len(want.token_ids) and got.token_ids[agreed] == want.token_ids[agreed]:
            token = want.token_ids[agreed]
            cuda_lp = got.logprobs[agreed][token].logprob
            cpu_lp = want.logprobs[agreed][token].logprob
            assert abs(cuda_lp - cpu_lp) <= LOGPROB_ATOL, (i, agreed, cuda_lp, cpu_lp)
            agreed += 1
        if agreed < len(want.token_ids):
            gap = _top2_gap(want.logprobs[agreed])
            assert gap < TIE_GAP, (
                f"prompt {i}: CUDA {got.token_ids} != CPU {want.token_ids} at {agreed}, "
                f"where the CPU engine's top-2 gap is {gap:.4f} nats (not a tie)"
            )


def test_embedded_model_cuda_matches_cpu(embedded_model_dir: Path) -> None:
    # The converted embedded model, or its random-weight stand-in where its GGUF is
    # missing (KVFLOW_TEST_EMBEDDED_DIR, set by run_gpu_checks.sh).
    path = str(embedded_model_dir)
    assert_greedy_parity(_generate(path, "cuda"), _generate(path, "cpu"))


@pytest.mark.parametrize("arch", FAMILIES)
def test_tiny_family_cuda_matches_cpu(tiny_model_dir: Any, arch: str) -> None:
    path = str(tiny_model_dir(arch))
    assert_greedy_parity(_generate(path, "cuda"), _generate(path, "cpu"))
