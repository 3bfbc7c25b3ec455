"""The offline engine agrees with HF transformers, whatever the batching does.

Greedy token ids must be identical to `transformers` `generate` (float32 on both
sides), and identical again when the same prompts run one by one, all at once, with a
tiny token budget (chunked prefill) and with a KV cache so small that requests are
preempted and recomputed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 16


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def greedy(max_tokens: int = MAX_TOKENS, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def generate_ids(llm: LLM, prompts: list[list[int]], one_by_one: bool = False) -> list[list[int]]:
    if one_by_one:
        return [llm.generate([p], greedy())[0].token_ids for p in prompts]
    return [o.token_ids for o in llm.generate(prompts, greedy())]


def tokenize(llm: LLM) -> list[list[int]]:
    return [list(llm.tokenizer.encode(p)) for p in PROMPTS]


@pytest.mark.embedded
def test_embedded_model_matches_transformers(embedded_model_dir: Path) -> None:
    llm = LLM(dtype="float32")
    prompts = tokenize(llm)
    assert generate_ids(llm, prompts) == hf_greedy(embedded_model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(tiny_model_dir: Any, arch: str) -> None:
    path = tiny_model_dir(arch)
    llm = LLM(str(path), dtype="float32")
    prompts = tokenize(llm)
    assert generate_ids(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)


def test_batching_chunking_and_preemption_do_not_change_tokens(tiny_model_dir: Any) -> None:
    path = str(tiny_model_dir("llama"))
    reference_llm = LLM(path, dtype="float32")
    prompts = tokenize(reference_llm)
    reference = generate_ids(reference_llm, prompts, one_by_one=True)
    assert generate_ids(reference_llm, prompts) == reference

    chunked = LLM(path, dtype="float32", max_num_batched_tokens=8, block_size=4)
    assert generate_ids(chunked, prompts) == reference

    # 10 blocks of 4 tokens: the four requests need up to 8 blocks each at the end.
    tight = LLM(path, dtype="float32", num_blocks=10, block_size=4)
    assert generate_ids(tight, prompts) == reference
    assert tight.engine.scheduler.num_preemptions > 0
    tight.engine.kv_cache.check_integrity()
    assert tight.engine.kv_cache.num_free_blocks == 10


def test_logprobs_match_transformers(tiny_model_dir: Any) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen2")
    llm = LLM(str(path), dtype="float32")
    prompt = tokenize(llm)[2]
    out = llm.generate([prompt], greedy(max_tokens=4, logprobs=5))[0]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    expected = logits.log_softmax(-1)[len(prompt) - 1 : -1]  # [4, vocab]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for position, entry in enumerate(out.logprobs):
        top = torch.topk(expected[position], 5)
        assert set(entry) >= set(top.indices.tolist())
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[position, token_id].item(), abs=1e-4)
        assert entry[out.token_ids[position]].rank == 1


def test_prompt_logprobs_match_transformers(tiny_model_dir: Any) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8)  # chunked prompt
    prompt = tokenize(llm)[2]
    out = llm.generate([prompt], greedy(max_tokens=1, prompt_logprobs=2))[0]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert entry is not None
        actual = expected[position - 1, prompt[position]].item()
        assert entry[prompt[position]].logprob == pytest.approx(actual, abs=1e-4)
