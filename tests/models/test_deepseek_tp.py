"""DeepSeek-V3 over two gloo CPU ranks gives the single-process logits: the attention
heads split (q_b_proj, kv_b_proj, o_proj by heads; the low-rank q_a / kv_a projections
and the latent cache whole on each rank), the experts split either way (tensor or
expert parallel), the shared expert as an MLP. A prefill into the paged latent cache
(decompressed attention), then a decode over it (absorbed). Two processes: slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_deepseek_parity import MLA, YARN, sharpen
from transformers import AutoModelForCausalLM, DeepseekV3Config

from kvflow.gpu_worker.attn_metadata import AttentionMetadata, forward_context
from kvflow.gpu_worker.model_loader import load_model
from kvflow.gpu_worker.parallel_state import tensor_parallel

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 8, 90, 3, 77, 21, 60, 11, 33]
BLOCK = 4


def _step(model: torch.nn.Module, tokens: list[int], start: int) -> torch.Tensor:
    """Logits of `tokens` at positions start.. of one request whose blocks are 0, 1, ..."""
    n, seq_len = len(tokens), start + len(tokens)
    md = AttentionMetadata(
        slot_mapping=torch.arange(start, seq_len),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.arange(4, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=seq_len,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[seq_len],
        logits_indices=torch.arange(n),
    )
    positions = torch.arange(start, seq_len)
    with torch.inference_mode(), forward_context(md):
        return model.compute_logits(model(torch.tensor(tokens), positions))


def _run(model_dir: Path) -> torch.Tensor:
    """[len(PROMPT) + 1, vocab]: the prompt's logits, then one decode's."""
    model = load_model(model_dir, torch.float32, torch.device("cpu"), "torch")
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(1, 4, BLOCK, 1, layer.head_dim)
    prefill = _step(model, PROMPT, 0)
    decode = _step(model, [int(prefill[-1].argmax())], len(PROMPT))
    return torch.cat((prefill, decode))


def _rank(rank: int, world: int, model_dir: Path, expert_parallel: bool) -> None:
    store = model_dir / f"store-{expert_parallel}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with tensor_parallel(world, rank, expert_parallel=expert_parallel):
            logits = _run(model_dir)
        torch.save(logits, model_dir / f"logits-{expert_parallel}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = DeepseekV3Config(
        **MLA, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters=YARN, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    sharpen(model, seed=4)
    path = tmp_path_factory.mktemp("tiny-deepseek-v3")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_match_one(model_dir: Path, expert_parallel: bool) -> None:
    expected = _run(model_dir)
    mp.spawn(_rank, args=(2, model_dir, expert_parallel), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(model_dir / f"logits-{expert_parallel}-{rank}.pt")
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
