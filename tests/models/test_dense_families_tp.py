"""Tensor parallelism (two gloo CPU processes) on the families whose layers split in
their own way: OLMo 2's q/k norms span the whole projection (each rank all-reduces its
squares; with 1 KV head both ranks hold a replica of it) and Phi-3's fused qkv / gate_up
checkpoint tensors are cut before each rank takes its slice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_dense_families_parity import sharpen
from test_tensor_parallel import _prefill, _rank_logits
from transformers import AutoModelForCausalLM, Olmo2Config, Phi3Config

from kvflow.gpu_worker.model_loader import load_model

pytestmark = pytest.mark.slow

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2)


@pytest.mark.parametrize(
    "config",
    [
        Olmo2Config(**SMALL, num_attention_heads=4, num_key_value_heads=1, pad_token_id=0),
        Phi3Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0),
    ],
    ids=["olmo2", "phi3"],
)
def test_two_ranks_match_one(tmp_path: Path, config: object) -> None:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config)
    sharpen(hf_model, seed=2)
    hf_model.save_pretrained(tmp_path)
    expected = _prefill(load_model(tmp_path, torch.float32, torch.device("cpu"), "torch"))
    mp.spawn(_rank_logits, args=(2, tmp_path, tmp_path / "store"), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"logits{rank}.pt")
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
