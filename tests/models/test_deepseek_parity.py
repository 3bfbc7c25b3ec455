"""DeepSeek-V2/V3 against transformers on tiny random-weight checkpoints.

Each config exercises a part of the families: V2-Lite's shape (no q bottleneck, plain
top-k softmax routing, a tied head), V2's (q bottleneck, group-limited routing over 4
groups), V3's (sigmoid routing with a correction bias over 4 groups, top-k renormalized,
YaRN with mscale_all_dim scaling the softmax) and V3 without interleaved RoPE. Every one
has a dense first layer and a shared expert. Weights get a large spread and the routers
a larger one, so that routing is decisive and greedy choices are far from ties; float32.

The paged runs take every attention path: a fresh prefill (latents decompressed into
K/V), a chunk over a cached prefix (decompressed from the cache) and decodes (queries
absorbed, attending the cached latents); on the Triton backend every request runs
absorbed in the paged kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, PretrainedConfig

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.layers.moe import FusedMoE
from kvflow.gpu_worker.model_loader import load_model

VOCAB = 96
MLA = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
    num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
    max_position_embeddings=256, eos_token_id=None,
)  # fmt: skip
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
    "mscale_all_dim": 0.8, "original_max_position_embeddings": 64,
}  # fmt: skip

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "v2-lite": lambda: DeepseekV2Config(
        **MLA, q_lora_rank=None, topk_method="greedy", tie_word_embeddings=True
    ),
    "v2-grouped": lambda: DeepseekV2Config(
        **MLA,
        q_lora_rank=24,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        tie_word_embeddings=False,
    ),
    "v3": lambda: DeepseekV3Config(
        **MLA,
        q_lora_rank=24,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=YARN,
        tie_word_embeddings=False,
    ),
    "v3-no-interleave": lambda: DeepseekV3Config(
        **MLA,
        q_lora_rank=24,
        n_group=1,
        topk_group=1,
        rope_interleave=False,
        tie_word_embeddings=False,
    ),
}


def sharpen(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(0.6 * noise)  # decisive routing
            else:
                param.copy_(0.15 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # moves the choice, not the weights
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, models_tmp: Path) -> tuple[Any, Path]:
    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    sharpen(hf_model, seed=1)
    path = models_tmp / f"deepseek-{request.param}"
    hf_model.save_pretrained(path, max_shard_size="200KB")  # sharded: several files + index
    return hf_model, path


@pytest.fixture(scope="module")
def kv_model(checkpoint: tuple[Any, Path]) -> torch.nn.Module:
    return load_model(checkpoint[1], torch.float32, torch.device("cpu"), "torch")


def test_dense_first_layer_then_experts(checkpoint, kv_model) -> None:
    _, path = checkpoint
    assert len(list(path.glob("*.safetensors"))) > 1
    layers = kv_model.model.layers
    assert not isinstance(layers[0].mlp, FusedMoE) and isinstance(layers[1].mlp, FusedMoE)
    assert layers[1].mlp.shared_experts is not None


def test_prefill_logits_match_transformers(checkpoint, kv_model, prefill_logits) -> None:
    hf_model, _ = checkpoint
    tokens = _prompt(13, seed=2)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    actual = prefill_logits(kv_model, tokens)
    assert expected.std() > 0.5
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_greedy_tokens_and_logprobs_match_transformers(
    checkpoint, paged_runner, backend: str
) -> None:
    """A prompt in two chunks (the second over the cached first), then decodes; a second
    request decodes beside it, so decodes and a prefill share steps."""
    hf_model, path = checkpoint
    model = load_model(path, torch.float32, torch.device("cpu"), backend)
    prompt, other = _prompt(9, seed=6), _prompt(5, seed=7)
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    hf_tokens = out.sequences[0, len(prompt) :].tolist()
    hf_logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    runner = paged_runner(model, num_blocks=16, block_size=4)
    runner.step([("r", prompt[:5])])
    logits = [runner.step([("r", prompt[5:]), ("o", other)])[0][-1]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < 6:
        logits.append(runner.step([("r", tokens[-1:]), ("o", [1])])[0][-1])
        tokens.append(int(logits[-1].argmax()))
    assert tokens == hf_tokens
    logprobs = torch.log_softmax(torch.stack(logits), dim=-1)
    torch.testing.assert_close(logprobs, hf_logprobs, atol=1e-4, rtol=1e-4)


def _rewrite(path: Path, dest: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    edit(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "config.json").write_text((path / "config.json").read_text())


def test_a_missing_expert_tensor_fails_naming_it(checkpoint, tmp_path: Path) -> None:
    _, path = checkpoint
    missing = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(path, tmp_path, lambda tensors: tensors.pop(missing))
    with pytest.raises(UnsupportedModelError, match=missing.replace(".", r"\.")):
        load_model(tmp_path, torch.float32, torch.device("cpu"), "torch")


def test_a_mismatched_latent_projection_fails_naming_it(checkpoint, tmp_path: Path) -> None:
    _, path = checkpoint
    name = "model.layers.0.self_attn.kv_b_proj.weight"

    def cut(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:, :-1].clone()

    _rewrite(path, tmp_path, cut)
    with pytest.raises(UnsupportedModelError, match=name.replace(".", r"\.") + ".*shape"):
        load_model(tmp_path, torch.float32, torch.device("cpu"), "torch")
