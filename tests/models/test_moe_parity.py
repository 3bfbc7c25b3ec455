"""kvflow's mixture-of-experts families against transformers on tiny random-weight
checkpoints: Qwen3-MoE (dense layers among sparse ones, both `norm_topk_prob`s),
Qwen2-MoE (a shared expert behind its sigmoid gate) and Mixtral (w1/w2/w3 experts).

Weights get a large spread and the routers a larger one, so that routing is decisive
(no near-tie between the k-th and k+1-th expert, which a last-bit difference could
flip) and every expert moves the logits. Float32: greedy tokens must be identical.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.layers.moe import FusedMoE
from kvflow.gpu_worker.model_loader import load_model

SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3-moe-dense-layer": lambda: Qwen3MoeConfig(
        **SMALL,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        head_dim=24,
    ),
    "qwen3-moe-sparse-step": lambda: Qwen3MoeConfig(
        **SMALL,
        intermediate_size=48,
        moe_intermediate_size=40,
        num_hidden_layers=2,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
    "qwen2-moe-shared": lambda: Qwen2MoeConfig(
        **SMALL,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "mixtral": lambda: MixtralConfig(
        **SMALL,
        intermediate_size=48,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.copy_(0.6 * noise)  # decisive routing
            else:
                param.copy_(0.15 * noise)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, models_tmp: Path) -> tuple[Any, Path]:
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


def test_the_families_build_their_moe_layers(checkpoint, kv_model) -> None:
    hf_model, _ = checkpoint
    sparse = [i for i, layer in enumerate(kv_model.model.layers) if isinstance(layer.mlp, FusedMoE)]
    hf_sparse = [
        i
        for i, layer in enumerate(hf_model.model.layers)
        if hasattr(getattr(layer, "mlp", layer), "experts")
    ]
    assert sparse == hf_sparse and sparse


def test_prefill_logits_match_transformers(checkpoint, kv_model, prefill_logits) -> None:
    hf_model, _ = checkpoint
    tokens = _prompt(13, seed=2)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    actual = prefill_logits(kv_model, tokens)
    assert expected.std() > 0.5
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_and_logprobs_match_transformers(checkpoint, kv_model, paged_runner) -> None:
    hf_model, _ = checkpoint
    prompt = _prompt(7, seed=6)
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    hf_tokens = out.sequences[0, 7:].tolist()
    hf_logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    runner = paged_runner(kv_model, num_blocks=8, block_size=4)
    logits = [runner.step([("r", prompt)])[0][-1]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < 8:
        logits.append(runner.step([("r", tokens[-1:])])[0][-1])
        tokens.append(int(logits[-1].argmax()))
    assert tokens == hf_tokens
    logprobs = torch.log_softmax(torch.stack(logits), dim=-1)
    torch.testing.assert_close(logprobs, hf_logprobs, atol=1e-4, rtol=1e-4)


def test_a_missing_expert_tensor_fails_naming_it(checkpoint, tmp_path: Path) -> None:
    _, path = checkpoint
    tensors = load_file(path / "model.safetensors")
    missing = next(name for name in sorted(tensors) if ".experts.1." in name)
    del tensors[missing]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match=missing.replace(".", r"\.")):
        load_model(tmp_path, torch.float32, torch.device("cpu"), "torch")


def test_quantization_is_refused_for_experts() -> None:
    """q8_0 covers linear layers only: a MoE model is refused, not left half float."""
    import pytest as _pytest
    from torch import nn

    from kvflow.errors import ConfigError
    from kvflow.gpu_worker.layers.moe import FusedExperts
    from kvflow.gpu_worker.quantization import quantize_model

    model = nn.Module()
    model.experts = FusedExperts.__new__(FusedExperts)
    nn.Module.__init__(model.experts)
    with _pytest.raises(ConfigError, match="experts"):
        quantize_model(model, "q8_0")
