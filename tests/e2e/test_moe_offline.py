"""A mixture-of-experts model offline: `load_format="dummy"` runs a directory holding only
config.json and tokenizer files, and CPU decode graphs replay the MoE layers (routing
and the fused experts' native call) to the eager engine's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.errors import KvflowError
from kvflow.gpu_worker.cpu_graphs import CpuDecodeGraphs
from kvflow.gpu_worker.layers.moe import FusedMoE
from kvflow.kernels.cpu import fused_moe
from kvflow.kernels.cpu.paged_decode import load_paged_decode

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
MAX_TOKENS = [6, 9, 12, 15]  # the decode batch shrinks 4, 3, 2, 1


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Path:
    """Qwen3-MoE's config.json (8 experts, top 2, a dense layer) + the embedded tokenizer."""
    from transformers import AutoTokenizer, Qwen3MoeConfig

    path = tmp_path_factory.mktemp("moe-config-only")
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    tokenizer.save_pretrained(path)
    Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        max_position_embeddings=512,
    ).save_pretrained(path)
    assert not list(path.glob("*.safetensors"))
    return path


def _generate(model_dir: Path, **options: Any) -> tuple[list[list[int]], Any]:
    llm = LLM(str(model_dir), load_format="dummy", num_threads=1, block_size=4, **options)
    try:
        moe = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
        assert len(moe) == 2
        params = [
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS
        ]
        outputs = llm.generate(PROMPTS, params)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.engine.runner.decode_graphs
    finally:
        llm.close()


def test_auto_load_format_needs_the_weights(config_only_dir: Path) -> None:
    with pytest.raises(KvflowError, match="safetensors"):
        LLM(str(config_only_dir), device="cpu", num_threads=1)


@pytest.mark.native(load_paged_decode() is not None and fused_moe.available())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_weights_run_and_decode_graphs_replay_like_eager(
    config_only_dir: Path, dtype: str
) -> None:
    eager, none = _generate(config_only_dir, dtype=dtype, enforce_eager=True)
    assert none is None
    assert [len(t) for t in eager] == MAX_TOKENS
    assert len({tuple(t) for t in eager}) == len(PROMPTS)  # random, not degenerate
    replayed, graphs = _generate(config_only_dir, dtype=dtype)
    assert isinstance(graphs, CpuDecodeGraphs) and not graphs.refused
    assert replayed == eager
