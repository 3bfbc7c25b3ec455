"""The pooling runner against transformers: `LLM(runner="pooling").embed()` gives
transformers' last hidden states pooled (LAST, MEAN, CLS) within 1e-4 cosine distance,
float32, for two families, through the real scheduler:

- chunked prefill: 8 tokens a request a step (`long_prefill_token_threshold`), so
  every prompt spans steps and shares them with the others;
- a prefix-cache hit: LAST takes it (its last token is always recomputed), MEAN and
  CLS never read the cache (they need position 0 on) and still pool right;
- preemption by recompute mid-prompt (16 KV blocks of 4 tokens for two 48-token
  prompts): what the worker accumulated for the victim is dropped;
- steps in flight (async scheduling) for LAST and MEAN; two tensor-parallel ranks (slow).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow import LLM, PoolingParams, SamplingParams
from kvflow.errors import InvalidRequestError, PromptTooLongError

MAX_MODEL_LEN = 64
ENGINE: dict[str, Any] = dict(
    dtype="float32", device="cpu", runner="pooling", block_size=4, num_blocks=16,
    max_num_batched_tokens=16, long_prefill_token_threshold=8, max_model_len=MAX_MODEL_LEN,
)  # fmt: skip


def _reference(model_dir: Path) -> Callable[[list[int], str], np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def pooled(ids: list[int], pooling_type: str) -> np.ndarray:
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
        return vector.double().numpy()  # type: ignore[no-any-return]

    return pooled


def _distance(got: list[float], want: np.ndarray) -> float:
    a = np.asarray(got, dtype=np.float64)
    return float(1 - a @ want / (np.linalg.norm(a) * np.linalg.norm(want)))


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in lengths]


@pytest.mark.parametrize(
    ("arch", "pooling_type", "async_scheduling"),
    [
        ("llama", "LAST", False),
        ("llama", "MEAN", False),
        ("llama", "CLS", False),
        ("llama", "LAST", True),
        ("llama", "MEAN", True),
        ("qwen3", "LAST", False),
        ("qwen3", "MEAN", False),
    ],
)
def test_embed_matches_transformers(
    tiny_model_dir: Callable[[str], Path], arch: str, pooling_type: str, async_scheduling: bool
) -> None:
    model_dir = tiny_model_dir(arch)
    reference = _reference(model_dir)
    llm = LLM(
        str(model_dir), pooler_config={"pooling_type": pooling_type},
        async_scheduling=async_scheduling, **ENGINE,
    )  # fmt: skip
    vocab = llm.engine.vocab_size
    try:
        kv_cache, scheduler = llm.engine.kv_cache, llm.engine.scheduler

        def check(prompts: list[list[int]]) -> None:
            outputs = llm.embed(prompts)
            for output, ids in zip(outputs, prompts):
                assert output.prompt_token_ids == ids
                assert abs(np.linalg.norm(output.outputs.embedding) - 1) < 1e-5
                assert _distance(output.outputs.embedding, reference(ids, pooling_type)) < 1e-4

        check(_prompts(0, [21, 5, 13], vocab))  # 3, 1 and 2 steps of 8 tokens, batched
        shared = _prompts(1, [24], vocab)[0]
        check([shared])
        hits = kv_cache.prefix_cache_hits
        check([shared[:20] + _prompts(2, [7], vocab)[0]])  # the first 5 blocks are cached
        assert (kv_cache.prefix_cache_hits > hits) == (pooling_type == "LAST")
        preemptions = scheduler.num_preemptions
        check(_prompts(3, [48, 48], vocab))  # 24 blocks needed at once, 16 held
        assert scheduler.num_preemptions > preemptions
        assert kv_cache.check_integrity() is None
    finally:
        llm.close()


def test_context_limits_options_and_refusals(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir("llama")
    reference = _reference(model_dir)
    options = {**ENGINE, "num_blocks": 64}
    llm = LLM(
        str(model_dir), pooler_config='{"pooling_type": "mean", "normalize": false}', **options
    )
    try:
        ids = _prompts(4, [MAX_MODEL_LEN + 1], llm.engine.vocab_size)[0]
        full = llm.embed([ids[1:]])[0]  # exactly the context: nothing is generated
        raw = reference(ids[1:], "MEAN")
        assert np.allclose(full.outputs.embedding, raw, atol=1e-4)  # normalize: false
        with pytest.raises(PromptTooLongError, match="context is 64"):
            llm.embed([ids])
        truncated = llm.embed([ids], truncate_prompt_tokens=MAX_MODEL_LEN)[0]
        assert truncated.prompt_token_ids == ids[1:]
        assert np.allclose(truncated.outputs.embedding, full.outputs.embedding, atol=1e-6)
        text = llm.embed("a text prompt")[0]
        assert text.prompt_token_ids == llm.tokenizer.encode("a text prompt")
        with pytest.raises(InvalidRequestError, match="Matryoshka"):
            llm.embed("x", PoolingParams(dimensions=8))
        with pytest.raises(InvalidRequestError, match="embed"):
            llm.generate("x", SamplingParams(max_tokens=2))
    finally:
        llm.close()
    generating = LLM(str(model_dir), dtype="float32", device="cpu", num_blocks=16)
    try:
        with pytest.raises(InvalidRequestError, match="runner='pooling'"):
            generating.embed("x")
    finally:
        generating.close()


@pytest.mark.slow
def test_tensor_parallel_pools_as_one_rank(tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = str(tiny_model_dir("llama"))
    options = {**ENGINE, "num_blocks": 64, "pooler_config": {"pooling_type": "MEAN"}}
    prompts = _prompts(5, [21, 5], 1000)
    vectors = []
    for tp in (1, 2):
        llm = LLM(model_dir, tensor_parallel_size=tp, **options)
        try:
            vectors.append([o.outputs.embedding for o in llm.embed(prompts)])
        finally:
            llm.close()
    assert np.allclose(vectors[0], vectors[1], atol=1e-5)
