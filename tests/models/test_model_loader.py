"""Model resolution, weight-loading strictness and the GGUF name/permutation mapping."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from kvflow.errors import ModelNotFoundError, UnsupportedModelError
from kvflow.gpu_worker.gguf_archs import ARCHS
from kvflow.gpu_worker.gguf_tensors import hf_tensor_name, unpermute_rows
from kvflow.gpu_worker.layers.rotary import rope_parameters
from kvflow.gpu_worker.model_files import CONVERTER_VERSION, gguf_cache_dir, resolve_model_dir
from kvflow.gpu_worker.model_loader import load_model
from kvflow.gpu_worker.models.registry import get_model_class


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute of Q/K rows (the operation we undo)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)  # 3 heads of dim 8
    permuted = _llama_cpp_permute(weight, 3)
    assert not np.array_equal(permuted, weight)
    assert permuted[:4, 0].tolist() == [0.0, 20.0, 5.0, 25.0]  # rows 0, 4, 1, 5 of head 0
    np.testing.assert_array_equal(unpermute_rows(permuted, 3), weight)


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.12.attn_q.bias", "model.layers.12.self_attn.q_proj.bias"),
        ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
    ],
)
def test_gguf_tensor_names(gguf_name: str, hf_name: str) -> None:
    assert hf_tensor_name(gguf_name, ARCHS["llama"]) == hf_name


def test_unknown_gguf_tensor_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight", ARCHS["llama"])


def test_resolve_model_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFoundError, match="does not download"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        resolve_model_dir(str(tmp_path.parent))


def test_gguf_cache_key_follows_size_and_mtime(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"0123")
    os.utime(gguf, ns=(1_000_000_000, 1_000_000_000))
    first = gguf_cache_dir(gguf, tmp_path / "cache")
    assert first == tmp_path / "cache" / "models" / f"m-4-1000000000-v{CONVERTER_VERSION}"
    os.utime(gguf, ns=(2_000_000_000, 2_000_000_000))
    assert gguf_cache_dir(gguf, tmp_path / "cache") != first


def test_unsupported_architecture() -> None:
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        get_model_class(["GPT2LMHeadModel"])


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


def test_loader_refuses_missing_and_unexpected_tensors(tiny_checkpoint: Path) -> None:
    path = tiny_checkpoint / "model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if "k_proj" not in k}, path)
    with pytest.raises(UnsupportedModelError, match=r"qkv_proj.weight \(shard 'k'\)"):
        load_model(tiny_checkpoint, torch.float32, torch.device("cpu"), "torch")
    save_file({**tensors, "model.extra.weight": torch.zeros(1)}, path)
    with pytest.raises(UnsupportedModelError, match=r"model\.extra\.weight"):
        load_model(tiny_checkpoint, torch.float32, torch.device("cpu"), "torch")


def test_loaded_model_is_inference_only_in_dtype(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, torch.bfloat16, torch.device("cpu"), "torch")
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    assert len(model.attention_layers()) == 1


def test_explicit_llama_config_reads_like_autoconfig(embedded_model_dir: Path) -> None:
    from transformers import AutoConfig

    from kvflow.gpu_worker.model_loader import load_hf_config

    fast = load_hf_config(embedded_model_dir)
    assert type(fast).__name__ == "SimpleNamespace"  # the embedded config is explicit
    full = AutoConfig.from_pretrained(str(embedded_model_dir))
    for field in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
        "vocab_size", "tie_word_embeddings", "attention_bias", "mlp_bias", "architectures",
    ):  # fmt: skip
        assert getattr(fast, field) == getattr(full, field), field
    assert rope_parameters(fast) == rope_parameters(full)
    assert getattr(fast, "sliding_window", None) == getattr(full, "sliding_window", None)


def test_other_configs_go_through_autoconfig(tiny_model_dir: Any) -> None:
    from kvflow.gpu_worker.model_loader import is_explicit_llama_config, load_hf_config

    assert type(load_hf_config(tiny_model_dir("qwen3"))).__name__ == "Qwen3Config"
    raw = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    for drop in ("num_key_value_heads", "rope_parameters", "head_dim"):
        assert not is_explicit_llama_config({k: v for k, v in raw.items() if k != drop})
    assert not is_explicit_llama_config({**raw, "rope_scaling": {"rope_type": "llama3"}})
