"""kvflow's Llama-family models against transformers on tiny random-weight checkpoints.

Each config exercises a family member: GQA, tied/untied embeddings, llama3 and yarn rope
scaling, Qwen2 q/k/v biases, Qwen3 q/k norms, Mistral's sliding window, and head dims
that are not powers of two (80, 48). Weights are drawn with a large spread (and norms,
biases away from their 1/0 init) so that every part of the model moves the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from kvflow.gpu_worker.attn_metadata import forward_context
from kvflow.gpu_worker.model_loader import load_model

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
}

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-gqa-untied": lambda: LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "llama3-rope-tied-bias": lambda: LlamaConfig(
        **SMALL,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters=LLAMA3_ROPE,
    ),
    "mistral-window-hd80": lambda: MistralConfig(
        **SMALL,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=80,
        sliding_window=5,
        tie_word_embeddings=False,
    ),
    "qwen2-bias-tied": lambda: Qwen2Config(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True
    ),
    "qwen3-qknorm-hd48-yarn": lambda: Qwen3Config(
        **SMALL,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        tie_word_embeddings=False,
        rope_parameters=YARN_ROPE,
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, models_tmp: Path) -> tuple[Any, Path]:
    """(HF model in float32, its saved directory), one per config."""
    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    _randomize(hf_model, seed=1)
    path = models_tmp / request.param
    hf_model.save_pretrained(path)
    return hf_model, path


@pytest.fixture(scope="module")
def kv_model(checkpoint: tuple[Any, Path]) -> torch.nn.Module:
    return load_model(checkpoint[1], torch.float32, torch.device("cpu"), "torch")


def _prompt(length: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(
        0, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_prefill_logits_match_transformers(checkpoint, kv_model, prefill_logits) -> None:
    hf_model, _ = checkpoint
    tokens = _prompt(13, seed=2)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    actual = prefill_logits(kv_model, tokens)
    assert actual.dtype == torch.float32 and actual.shape == (13, 96)
    assert expected.std() > 0.5  # the random weights make the logits far from uniform
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_paged_mixed_batches_match_full_prefill(kv_model, paged_runner, prefill_logits) -> None:
    """Chunked prefill on a cached prefix, decodes (contiguous and scattered rows), a fresh
    prefill and padding rows, mixed across requests, give the full-prefill logits."""
    a, b, c = _prompt(14, seed=3), _prompt(9, seed=4), _prompt(6, seed=5)
    runner = paged_runner(kv_model, num_blocks=12, block_size=4)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}

    def run(chunks: list[tuple[str, list[int]]], num_padding: int = 0) -> None:
        for (name, _), logits in zip(chunks, runner.step(chunks, num_padding)):
            got[name].append(logits)

    run([("a", a[0:5]), ("b", b[0:7])])  # two fresh prefills
    run([("b", b[7:8]), ("a", a[5:9])])  # decode + chunk over a 5-token prefix
    run([("a", a[9:10]), ("c", c[0:6]), ("b", b[8:9])], num_padding=3)  # scattered decodes
    run([("a", a[10:11])])  # a lone decode
    run([("a", a[11:14])])  # final chunk crossing a block boundary
    for name, prompt in (("a", a), ("b", b), ("c", c)):
        expected = prefill_logits(kv_model, prompt)
        torch.testing.assert_close(torch.cat(got[name]), expected, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(checkpoint, kv_model, paged_runner) -> None:
    hf_model, _ = checkpoint
    prompt = _prompt(7, seed=6)
    with torch.inference_mode():
        hf_out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )[0, 7:].tolist()
    runner = paged_runner(kv_model, num_blocks=8, block_size=4)
    tokens = [int(runner.step([("r", prompt)])[0][-1].argmax())]
    while len(tokens) < 8:
        tokens.append(int(runner.step([("r", tokens[-1:])])[0][-1].argmax()))
    assert tokens == hf_out


def test_output_rows_get_their_logits_and_every_row_its_kv(kv_model, paged_runner, prefill_logits):
    """With `output_rows` the last layer projects and runs its MLP only for those rows
    (any order, or none), yet stores every token's K/V: a later decode reads them all."""
    a = _prompt(11, seed=7)
    expected = prefill_logits(kv_model, a)
    runner = paged_runner(kv_model, num_blocks=8, block_size=4)
    md, positions = runner.metadata([("a", a[:10])])
    ids, pos = torch.tensor(a[:10]), torch.tensor(positions)
    with torch.inference_mode(), forward_context(md):
        hidden = kv_model(ids, pos, output_rows=torch.tensor([9, 3]))
        logits = kv_model.compute_logits(hidden)
        none = kv_model(ids, pos, output_rows=torch.tensor([], dtype=torch.int64))
    assert hidden.shape == (2, kv_model.config.hidden_size) and none.shape[0] == 0
    torch.testing.assert_close(logits, expected[[9, 3]], atol=1e-4, rtol=1e-4)
    (decoded,) = runner.step([("a", a[10:11])])
    torch.testing.assert_close(decoded, expected[10:11], atol=1e-4, rtol=1e-4)
