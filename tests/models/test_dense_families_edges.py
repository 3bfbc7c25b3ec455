"""Edges of the dense families: length-dependent RoPE (dynamic NTK, LongRoPE's long
factors) against transformers past the original context, soft-capped layers on the
native CPU backend, and what fails at start-up (an unknown rope type, a missing tensor)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dense_families_parity import HEADS, SMALL, longrope, prompt, sharpen
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Phi3Config

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.model_loader import load_model
from kvflow.kernels.cpu.paged_decode import load_paged_decode


def save(config: Any, path: Path) -> Any:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    sharpen(hf_model, seed=1)
    hf_model.save_pretrained(path)
    return hf_model


@pytest.mark.parametrize(
    "name, config",
    [
        (
            "dynamic-ntk",
            LlamaConfig(
                **SMALL,
                **HEADS,
                max_position_embeddings=8,
                rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
            ),
        ),
        (
            "longrope-long",
            Phi3Config(
                **SMALL,
                **HEADS,
                max_position_embeddings=64,
                rope_parameters=longrope(16),
                pad_token_id=0,
            ),
        ),
    ],
)
def test_length_dependent_rope_matches_transformers(
    name: str, config: Any, models_tmp: Path, prefill_logits, paged_runner
) -> None:
    """A prompt past the original context (8, 16) takes the scaled frequencies, in one
    prefill and in decode steps; one within it takes the plain ones."""
    hf_model = save(config, models_tmp / name)
    model = load_model(models_tmp / name, torch.float32, torch.device("cpu"), "torch")
    for length in (6, 21):
        tokens = prompt(length, seed=length)
        with torch.inference_mode():
            expected = hf_model(torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(prefill_logits(model, tokens), expected, atol=1e-4, rtol=1e-4)
    # Cached decoding: the prefix keeps the rotation of its own length and the decode
    # token takes that of 22 tokens, as transformers' generate does with its cache.
    tokens = prompt(22, seed=9)
    runner = paged_runner(model, num_blocks=8, block_size=4)
    (prefilled,) = runner.step([("r", tokens[:21])])
    (decoded,) = runner.step([("r", tokens[21:])])
    with torch.inference_mode():
        first = hf_model(torch.tensor([tokens[:21]]), use_cache=True)
        cache = first.past_key_values
        step = hf_model(torch.tensor([tokens[21:]]), past_key_values=cache, use_cache=True)
    torch.testing.assert_close(prefilled, first.logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoded, step.logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.native(load_paged_decode() is not None)
def test_soft_capped_layers_on_the_native_backend(models_tmp: Path, paged_runner) -> None:
    """The native kernels have no soft-cap: capped layers must take the torch path, so
    the `cpu` backend gives transformers' tokens too."""
    config = Gemma2Config(
        **SMALL,
        **HEADS,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=20.0,
    )
    hf_model = save(config, models_tmp / "gemma2-native")
    model = load_model(models_tmp / "gemma2-native", torch.float32, torch.device("cpu"), "cpu")
    tokens = prompt(9, seed=11)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    runner = paged_runner(model, num_blocks=8, block_size=4)
    logits = torch.cat(
        [runner.step([("r", tokens[:6])])[0]] + [runner.step([("r", [t])])[0] for t in tokens[6:]]
    )
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_unknown_rope_type_fails_at_start_with_its_name(models_tmp: Path) -> None:
    path = models_tmp / "mystery-rope"
    save(LlamaConfig(**SMALL, **HEADS), path)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"type": "mystery_rope", "factor": 2.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported rope type 'mystery_rope'"):
        load_model(path, torch.float32, torch.device("cpu"), "torch")


@pytest.mark.parametrize(
    "config, dropped",
    [
        (
            Gemma2Config(**SMALL, **HEADS, head_dim=16),
            "model.layers.1.pre_feedforward_layernorm.weight",
        ),
        (Phi3Config(**SMALL, **HEADS, pad_token_id=0), "model.layers.0.self_attn.qkv_proj.weight"),
        (LlamaConfig(**SMALL, **HEADS), "model.layers.1.mlp.up_proj.weight"),
    ],
)
def test_missing_tensor_fails_with_its_name(config: Any, dropped: str, models_tmp: Path) -> None:
    path = models_tmp / f"missing-{config.model_type}"
    save(config, path)
    tensors = load_file(path / "model.safetensors")
    assert dropped in tensors
    del tensors[dropped]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=dropped.replace(".", r"\.")):
        load_model(path, torch.float32, torch.device("cpu"), "torch")
