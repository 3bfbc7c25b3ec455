"""A mixture of experts over two gloo CPU ranks gives the single-process logits, both
ways of splitting the experts: each expert's intermediate features (tensor parallel)
and whole experts per rank (expert parallel). Qwen2-MoE, so the shared expert (an MLP
split like any other) and its gate ride along. Two processes: slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from kvflow.gpu_worker.attn_metadata import AttentionMetadata, forward_context
from kvflow.gpu_worker.layers.moe import FusedMoE
from kvflow.gpu_worker.model_loader import load_model
from kvflow.gpu_worker.parallel_state import tensor_parallel

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 8, 90, 3, 77, 21, 60, 11, 33]


def _prefill(model: torch.nn.Module) -> torch.Tensor:
    n = len(PROMPT)
    md = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        logits_indices=torch.arange(n),
    )
    with torch.inference_mode(), forward_context(md):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(n)))


def _rank(rank: int, world: int, model_dir: Path, expert_parallel: bool) -> None:
    store = model_dir / f"store-{expert_parallel}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with tensor_parallel(world, rank, expert_parallel=expert_parallel):
            model = load_model(model_dir, torch.float32, torch.device("cpu"), "torch")
        moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
        packed = moe.experts.packed  # the CPU kernel's copy of this rank's shard
        assert packed is not None and moe.experts.w13_weight.numel() == 0  # held once
        experts, hidden, inter = packed.experts, packed.hidden, packed.inter
        layout = {
            "first_expert": moe.experts.first_expert,
            "w13": [experts, 2 * inter, hidden],
            "w2": [experts, hidden, inter],
        }
        tag = f"{expert_parallel}-{rank}"
        (model_dir / f"layout-{tag}.json").write_text(json.dumps(layout))
        torch.save(_prefill(model), model_dir / f"logits-{tag}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = Qwen2MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config)
    with torch.no_grad():  # away from the init: every part moves the logits
        for param in model.parameters():
            param.copy_(param + 0.15 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("tiny-qwen2-moe")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_match_one(model_dir: Path, expert_parallel: bool) -> None:
    expected = _prefill(load_model(model_dir, torch.float32, torch.device("cpu"), "torch"))
    mp.spawn(_rank, args=(2, model_dir, expert_parallel), nprocs=2, join=True)
    for rank in range(2):
        tag = f"{expert_parallel}-{rank}"
        got = torch.load(model_dir / f"logits-{tag}.pt")
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        layout = json.loads((model_dir / f"layout-{tag}.json").read_text())
        if expert_parallel:  # 2 of the 4 experts each, whole
            assert layout == {"first_expert": 2 * rank, "w13": [2, 64, 64], "w2": [2, 64, 32]}
        else:  # all 4 experts, half of each one's 32 intermediate features
            assert layout == {"first_expert": 0, "w13": [4, 32, 64], "w2": [4, 64, 16]}
