"""Tensor parallelism over two gloo CPU processes gives the single-process logits.

The config has 4 query heads and 1 KV head, so at tp=2 each rank holds 2 query heads and
a replica of the KV head; the vocabulary (97) does not split evenly, so the last rank's
embedding rows are padding. Two processes that each import torch and transformers: slow.

With GGUF blocks beside the weights (as a converted GGUF has them), each rank slices the
blocks like its weights: column-parallel rows, the LM head's padded vocabulary rows, and
row-parallel columns where a rank's half of the input is whole blocks (o_proj: 64 -> 32
per rank) but not where it cuts through one (down_proj: 96 -> 48).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from kvflow.gpu_worker.attn_metadata import AttentionMetadata, forward_context
from kvflow.gpu_worker.block_weights import BLOCKS_FILE
from kvflow.gpu_worker.model_loader import load_model
from kvflow.gpu_worker.parallel_state import tensor_parallel
from kvflow.kernels.cpu import block_linear

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 8, 96, 3, 77, 21, 60]


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


def _rank_logits(rank: int, world: int, model_dir: Path, store: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with tensor_parallel(world, rank):
            model = load_model(model_dir, torch.float32, torch.device("cpu"), "torch")
        torch.save(_prefill(model), model_dir / f"logits{rank}.pt")
        with_blocks = sorted(n for n, m in model.named_modules() if getattr(m, "blocks", None))
        (model_dir / f"blocks{rank}.txt").write_text("\n".join(with_blocks))
    finally:
        dist.destroy_process_group()


def _quantize_in_place(model: torch.nn.Module, model_dir: Path) -> None:
    """Round every matrix through Q8_0 blocks and write the blocks file a converted GGUF has."""
    from safetensors.torch import save_file

    blocks, formats = {}, {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and name != "lm_head.weight":
                raw = gguf.quants.quantize(param.numpy(), gguf.GGMLQuantizationType.Q8_0)
                param.copy_(
                    torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
                )
                blocks[name], formats[name] = torch.from_numpy(raw), "Q8_0"
    (model_dir / BLOCKS_FILE).parent.mkdir(parents=True)
    save_file(blocks, model_dir / BLOCKS_FILE, formats)


@pytest.mark.parametrize("gguf_blocks", [False, True])
def test_two_ranks_match_one(tmp_path: Path, gguf_blocks: bool) -> None:
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf_model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # biases and norms away from their 0/1 init, so sharding shows
        for param in hf_model.parameters():
            param.copy_(param + 0.1 * torch.randn_like(param))
    if gguf_blocks:
        _quantize_in_place(hf_model, tmp_path)
    hf_model.save_pretrained(tmp_path)
    expected = _prefill(load_model(tmp_path, torch.float32, torch.device("cpu"), "torch"))
    mp.spawn(_rank_logits, args=(2, tmp_path, tmp_path / "store"), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"logits{rank}.pt")
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        with_blocks = (tmp_path / f"blocks{rank}.txt").read_text().split()
        if gguf_blocks and block_linear.available():
            assert with_blocks == sorted(
                ["lm_head"]
                + [f"model.layers.{i}.mlp.gate_up_proj" for i in range(2)]
                + [
                    f"model.layers.{i}.self_attn.{p}"
                    for i in range(2)
                    for p in ("o_proj", "qkv_proj")
                ]
            )
        else:
            assert with_blocks == []
