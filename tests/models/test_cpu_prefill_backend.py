"""The `cpu` backend's native causal prefill end to end: greedy parity with SDPA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu.prefill_attention import PrefillAttention, load_prefill_attention

_kernel = load_prefill_attention()


@pytest.fixture(scope="module")
def head_dim_32_model(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> str:
    """A tiny random llama whose head_dim (32) the kernel supports; GQA 2."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-hd32")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.native(_kernel is not None and _kernel.supports(__import__("torch").zeros(1, 1, 32)))
def test_native_prefill_matches_sdpa(head_dim_32_model: str, monkeypatch: Any) -> None:
    """Fresh prompts (native kernel) and chunks on a cached prefix (SDPA) in one run, as
    the small token budget splits the long prompts; tokens equal the torch backend's."""
    calls = []
    original = PrefillAttention.__call__

    def counting(self: PrefillAttention, *args: Any, **kwargs: Any) -> None:
        calls.append(args[0].shape[0])
        original(self, *args, **kwargs)

    monkeypatch.setattr(PrefillAttention, "__call__", counting)
    prompts = [[1, 2, 3, 4, 5, 6, 7], list(range(100, 161)), [5] * 18, [42, 43]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=32)
    torch_out = LLM(head_dim_32_model, attention_backend="torch", **options).generate(
        prompts, params
    )
    assert not calls
    cpu_out = LLM(head_dim_32_model, attention_backend="cpu", **options).generate(prompts, params)
    assert [o.token_ids for o in cpu_out] == [o.token_ids for o in torch_out]
    assert calls and max(calls) > 1  # the fresh prefills went native
