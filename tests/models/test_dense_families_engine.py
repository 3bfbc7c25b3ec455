"""Dense families through the real offline engine; greedy tokens must equal
transformers' generate at float32.

Gemma 2 (sliding window, soft-caps): one engine run mixes everything the window, the caps
and the paged cache must survive: prompts longer than the window, chunked prefill (a
token budget of 8), prefix-cache hits on a shared prompt prefix and preemption by a KV
cache too small for the batch. Phi-3 (LongRoPE): a batch of one request within the
original context and one past it, decoded together (CPU decode graphs replaying the
per-request choice of short or long factors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_dense_families_parity import longrope, sharpen
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Phi3Config

from kvflow import LLM, SamplingParams

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(embedded_model_dir))


def save(config: Any, tokenizer: Any, path: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    sharpen(model, seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma2_dir(models_tmp: Path, tokenizer: Any) -> Path:
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=80.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    return save(config, tokenizer, models_tmp / "gemma2-engine")


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_chunked_prefill_prefix_hits_and_preemption_match_transformers(gemma2_dir: Path) -> None:
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(100, 4000, (13,), generator=generator).tolist()
    prompts = [
        prefix + torch.randint(100, 4000, (n,), generator=generator).tolist() for n in (3, 6, 2, 5)
    ]
    expected = hf_greedy(gemma2_dir, prompts)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # 18 blocks of 4 tokens (one layer's K/V each: the hybrid cache's three groups of
    # one layer): a request of up to 29 tokens holds up to 8 blocks in the full group and
    # 5 in each sliding one (window 6 + a chunk of 8), so the four preempt each other.
    llm = LLM(
        str(gemma2_dir),
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=8,
        block_size=4,
        num_blocks=18,
    )
    first = llm.generate(prompts[:1], greedy)  # caches the shared prefix's blocks
    rest = llm.generate(prompts[1:], greedy)
    assert [o.token_ids for o in first + rest] == expected
    assert llm.engine.kv_cache.prefix_cache_hits > 0
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.kv_cache.check_integrity()


def test_longrope_requests_within_and_past_the_original_context(
    models_tmp: Path, tokenizer: Any
) -> None:
    config = Phi3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters=longrope(16),
        pad_token_id=0,
    )  # original context 16: 5 + 10 tokens stay within it, 20 + 10 start past it
    path = save(config, tokenizer, models_tmp / "phi3-engine")
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 4000, (n,), generator=generator).tolist() for n in (5, 20)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == hf_greedy(path, prompts)
