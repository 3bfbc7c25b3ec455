"""What the tensor- and pipeline-parallel parity tests share: a tiny model whose shapes
do not split evenly, and a two-batch workload with shared prefixes."""

from __future__ import annotations

from pathlib import Path

import torch

PREFIX = "In a quiet village by the sea there lived an old fisherman who every morning "
FIRST = [PREFIX + "went out", "Hello", "The list of the primes begins with two, three, five"]
SECOND = [PREFIX + "sang", PREFIX + "counted the boats", "Hi"]


def save_uneven_qwen2(path: Path, tokenizer_dir: Path, num_layers: int) -> Path:
    """Qwen2 with `num_layers` layers, 1 KV head for 4 query heads and a vocabulary of
    the tokenizer + 1 (odd), random weights (seeded), saved with the tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen2Config(
        vocab_size=len(tokenizer) + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
