"""The dense families beyond Llama against transformers, on tiny random-weight checkpoints.

One config per family, each exercising what that family adds to the shared decoder:
Gemma 2 (sandwich (1 + w) norms, alternating local/global layers with a window shorter
than the prompts, attention and final soft-caps, query_pre_attn_scalar, scaled
embeddings, GELU-tanh), Gemma 3 (q/k norms, a RoPE table per layer type, linear scaling
on the global one), Phi-3 (fused qkv / gate_up checkpoints, LongRoPE), Phi-4-mini
(partial rotary, tied head), OLMo 2 (post-norm, whole-projection q/k norms), Granite
(four multipliers) and SmolLM3 (NoPE layers). The LM head is scaled up so that greedy
choices are far from ties.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    SmolLM3Config,
)

from kvflow.gpu_worker.attn_metadata import forward_context
from kvflow.gpu_worker.model_loader import load_model

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
ROWS = torch.tensor([9, 3])  # output rows, in any order


def longrope(dim: int) -> dict[str, Any]:
    """LongRoPE factors for a rotary dim: short ones near 1, long ones larger."""
    half = dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": 16,
    }


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "gemma2": lambda: Gemma2Config(
        **SMALL,
        **HEADS,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=20.0,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **SMALL,
        **HEADS,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
    ),
    "phi3": lambda: Phi3Config(
        **SMALL,
        **HEADS,
        max_position_embeddings=64,
        rope_parameters=longrope(16),
        tie_word_embeddings=False,
        pad_token_id=0,
    ),
    "phi4-mini": lambda: Phi3Config(
        **SMALL,
        **HEADS,
        max_position_embeddings=64,
        rope_parameters={**longrope(12), "partial_rotary_factor": 0.75},
        tie_word_embeddings=True,
        pad_token_id=0,
    ),
    "olmo2": lambda: Olmo2Config(**SMALL, **HEADS, pad_token_id=0),
    "granite": lambda: GraniteConfig(
        **SMALL,
        **HEADS,
        embedding_multiplier=6.0,
        residual_multiplier=0.5,
        attention_multiplier=0.05,
        logits_scaling=0.5,
    ),
    "smollm3": lambda: SmolLM3Config(**SMALL, **HEADS, no_rope_layers=[0, 1], pad_token_id=0),
}


def sharpen(model: torch.nn.Module, seed: int) -> None:
    """Large random weights (norms away from their init) and an LM head scaled up, so
    every part moves the logits and the greedy choice is rarely a near tie."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
        model.get_output_embeddings().weight.mul_(3.0)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, models_tmp: Path) -> tuple[Any, Path]:
    """(HF model in float32, its saved directory), one per family."""
    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    sharpen(hf_model, seed=1)
    path = models_tmp / f"dense-{request.param}"
    hf_model.save_pretrained(path, max_shard_size="40KB")  # sharded: an index + files
    return hf_model, path


@pytest.fixture(scope="module")
def kv_model(checkpoint: tuple[Any, Path]) -> torch.nn.Module:
    return load_model(checkpoint[1], torch.float32, torch.device("cpu"), "torch")


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def test_checkpoints_are_sharded_and_name_their_family(checkpoint, kv_model) -> None:
    hf_model, path = checkpoint
    assert len(list(path.glob("*.safetensors"))) > 1
    assert type(kv_model).__name__ == type(hf_model).__name__


def test_prefill_logits_and_logprobs_match_transformers(checkpoint, kv_model, prefill_logits):
    hf_model, _ = checkpoint
    tokens = prompt(13, seed=2)  # longer than Gemma's window (4)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    actual = prefill_logits(kv_model, tokens)
    assert expected.std() > 0.5  # the random weights make the logits far from uniform
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        actual.log_softmax(-1), expected.log_softmax(-1), atol=1e-4, rtol=1e-4
    )


def test_paged_mixed_batches_match_full_prefill(kv_model, paged_runner, prefill_logits) -> None:
    """Chunks over a cached prefix (past the window), decodes and a fresh prefill, mixed
    across requests, give the full-prefill logits."""
    a, b, c = prompt(14, seed=3), prompt(9, seed=4), prompt(6, seed=5)
    runner = paged_runner(kv_model, num_blocks=12, block_size=4)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    steps = [
        [("a", a[0:5]), ("b", b[0:7])],
        [("b", b[7:8]), ("a", a[5:9])],
        [("a", a[9:10]), ("c", c[0:6]), ("b", b[8:9])],
        [("a", a[10:11])],
        [("a", a[11:14])],
    ]
    for chunks in steps:
        for (name, _), logits in zip(chunks, runner.step(chunks)):
            got[name].append(logits)
    for name, tokens in (("a", a), ("b", b), ("c", c)):
        expected = prefill_logits(kv_model, tokens)
        torch.testing.assert_close(torch.cat(got[name]), expected, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(checkpoint, kv_model, paged_runner) -> None:
    hf_model, _ = checkpoint
    tokens = prompt(7, seed=6)  # longer than Gemma's window, and the output runs past it
    with torch.inference_mode():
        hf_out = hf_model.generate(
            torch.tensor([tokens]), max_new_tokens=10, do_sample=False, pad_token_id=0
        )[0, 7:].tolist()
    runner = paged_runner(kv_model, num_blocks=8, block_size=4)
    out = [int(runner.step([("r", tokens)])[0][-1].argmax())]
    while len(out) < 10:
        out.append(int(runner.step([("r", out[-1:])])[0][-1].argmax()))
    assert out == hf_out


def test_output_rows_get_their_logits_and_every_row_its_kv(kv_model, paged_runner, prefill_logits):
    """The last block (sandwich, post-norm or pre-norm) run for `output_rows` alone still
    stores every token's K/V, and those rows get the full prefill's logits."""
    tokens = prompt(11, seed=7)
    expected = prefill_logits(kv_model, tokens)
    runner = paged_runner(kv_model, num_blocks=8, block_size=4)
    md, positions = runner.metadata([("a", tokens[:10])])
    with torch.inference_mode(), forward_context(md):
        hidden = kv_model(torch.tensor(tokens[:10]), torch.tensor(positions), output_rows=ROWS)
        logits = kv_model.compute_logits(hidden)
    torch.testing.assert_close(logits, expected[ROWS], atol=1e-4, rtol=1e-4)
    (decoded,) = runner.step([("a", tokens[10:11])])
    torch.testing.assert_close(decoded, expected[10:11], atol=1e-4, rtol=1e-4)
