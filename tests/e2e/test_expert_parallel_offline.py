"""`LLM(tensor_parallel_size=2)` on a mixture of experts, with `enable_expert_parallel`
and without, gives one rank's greedy tokens: the flag reaches every rank's layers
(config -> RankInit -> tensor_parallel group -> FusedMoE)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_models import FIRST

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", device="cpu", num_threads=1, num_blocks=64)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Path:
    """Qwen3-MoE, 4 experts (top 2) and a dense layer, with the embedded tokenizer."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(2)
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _greedy(model_dir: Path, **options: Any) -> list[list[int]]:
    llm = LLM(str(model_dir), **ENGINE, **options)  # type: ignore[arg-type]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        return [list(out.outputs[0].token_ids) for out in llm.generate(FIRST, params)]
    finally:
        llm.close()


def test_tp2_with_and_without_expert_parallel_equals_tp1(moe_model_dir: Path) -> None:
    want = _greedy(moe_model_dir)
    assert len({tuple(tokens) for tokens in want}) > 1  # the prompts lead somewhere different
    assert _greedy(moe_model_dir, tensor_parallel_size=2) == want
    assert _greedy(moe_model_dir, tensor_parallel_size=2, enable_expert_parallel=True) == want
