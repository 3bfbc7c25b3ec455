"""The hybrid KV cache end to end: Gemma 2 and Gemma 3 tiny models (local and global
layers, a window shorter than the prompts) through the offline engine on every
attention backend (torch, the CPU native path, Triton: interpreted on CPU) give
transformers' greedy tokens, under chunked prefill, prefix-cache hits and preemption,
with several block tables per request and blocks released as requests pass the
window. Here (not in tests/models) because kernels/conftest.py sets TRITON_INTERPRET."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
)

from kvflow import LLM, SamplingParams
from kvflow.kv_groups import plan_kv_groups

MAX_TOKENS = 8
WINDOW = 6
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=WINDOW,
    query_pre_attn_scalar=16,
)
CONFIGS = {
    "gemma2": lambda vocab: Gemma2Config(
        vocab_size=vocab,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=3.0,
        final_logit_softcapping=80.0,
        **SHAPE,
    ),
    "gemma3": lambda vocab: Gemma3TextConfig(
        vocab_size=vocab,
        num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        **SHAPE,
    ),
    # Every layer windowed: one group, which still releases blocks.
    "mistral": lambda vocab: MistralConfig(
        vocab_size=vocab,
        num_hidden_layers=2,
        **{k: v for k, v in SHAPE.items() if k != "query_pre_attn_scalar"},
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_and_expected(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, embedded_model_dir
) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(checkpoint directory, prompts, transformers' greedy tokens for them)."""
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        CONFIGS[request.param](len(tokenizer)), attn_implementation="eager"
    ).eval()
    with torch.no_grad():  # sharper logits: greedy choices far from ties
        model.get_output_embeddings().weight.mul_(4.0)
    path = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(100, 4000, (13,), generator=generator).tolist()
    prompts = [
        prefix + torch.randint(100, 4000, (n,), generator=generator).tolist() for n in (3, 6, 4)
    ]
    return path, prompts, hf_greedy(path, prompts)


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
            )  # fmt: skip
            expected.append(out[0, len(prompt) :].tolist())
    return expected


# Triton interpreted on a CPU takes ~15-50 s a family: slow (it runs in CI all the same).
@pytest.mark.parametrize(
    "backend", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.slow)]
)
def test_hybrid_cache_matches_transformers_with_hits_and_preemption(
    model_and_expected: tuple[Path, list[list[int]], list[list[int]]], backend: str
) -> None:
    path, prompts, expected = model_and_expected
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # Blocks of 4 tokens, each one layer's K/V (groups of one layer). A request of up to
    # 27 tokens holds up to 7 blocks in the full group and 5 in each sliding one (window
    # 6 + a chunk of 8). A pool of one request's worst case makes them preempt each other.
    groups = plan_kv_groups(layer_windows(path)).windows
    llm = LLM(
        str(path), dtype="float32", attention_backend=backend, max_num_batched_tokens=8,
        block_size=4, num_blocks=sum(7 if w is None else 5 for w in groups), max_num_seqs=3,
    )  # fmt: skip
    kv_cache = llm.engine.kv_cache
    assert tuple(g.window for g in kv_cache.groups) == groups
    first = llm.generate(prompts[:1], greedy)  # caches the shared prefix's blocks
    kv_cache.check_integrity()
    rest = llm.generate(prompts[1:], greedy)
    assert [o.token_ids for o in first + rest] == expected
    assert kv_cache.prefix_cache_hits > 0
    assert llm.engine.scheduler.num_preemptions > 0
    kv_cache.check_integrity()
    assert kv_cache.num_free_blocks == kv_cache.num_blocks


def layer_windows(path: Path) -> list[int | None]:
    """The sliding window of each layer of the checkpoint (None: global)."""
    config = AutoConfig.from_pretrained(path)
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * 2
    return [WINDOW if t == "sliding_attention" else None for t in types]


def test_hybrid_off_keeps_one_group_and_the_same_tokens(
    model_and_expected: tuple[Path, list[list[int]], list[list[int]]],
) -> None:
    path, prompts, expected = model_and_expected
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", attention_backend="torch", hybrid_kv_cache=False)
    assert [g.window for g in llm.engine.kv_cache.groups] == [None]
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.slow  # ~10 s a case (two engines' worth of transformers and kvflow runs)
@pytest.mark.parametrize(
    "options",
    [{"async_scheduling": True}, {"speculative_config": SPEC}],
    ids=["async-scheduling", "ngram-spec"],
)
def test_hybrid_cache_under_async_scheduling_and_speculation(
    model_and_expected: tuple[Path, list[list[int]], list[list[int]]], options: dict[str, Any]
) -> None:
    """Steps in flight (the next allocation releases blocks while a step still runs) and
    drafts rolled back give transformers' tokens too. Each prompt is repeated after its
    own continuation, so n-gram speculation finds drafts to propose."""
    path, prompts, expected = model_and_expected
    prompts = [p + e + p for p, e in zip(prompts, expected)]
    expected = hf_greedy(path, prompts)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(
        str(path), dtype="float32", attention_backend="torch", max_num_batched_tokens=8,
        block_size=4, **options,
    )  # fmt: skip
    assert any(g.window == WINDOW for g in llm.engine.kv_cache.groups)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    speculator = llm.engine.scheduler.speculator
    if speculator is not None:
        assert speculator.counters.num_draft_tokens > 0
    llm.engine.kv_cache.check_integrity()
