"""GGUF -> HF conversion of synthetic llama / qwen2 / qwen3 files written like llama.cpp.

A tiny random HF model is written with gguf.GGUFWriter under llama.cpp's tensor names
(Q/K rows permuted for the llama arch, as convert_hf_to_gguf does), converted back, and
loaded by kvflow: its logits must equal the original model's. Tensors are F32, so the
round trip is exact; the tokenizer step is covered by the embedded-model test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from kvflow.gpu_worker import gguf_convert
from kvflow.gpu_worker.model_loader import load_model

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": lambda: Qwen2Config(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "qwen3": lambda: Qwen3Config(
        **SMALL, num_attention_heads=2, num_key_value_heads=1, head_dim=24
    ),
}
HF_TO_GGUF = {hf: gg for gg, hf in gguf_convert.BLOCK_TENSORS.items()}


def _gguf_name(hf_name: str) -> str:
    for gg, hf in gguf_convert.GLOBAL_TENSORS.items():
        if hf_name.startswith(hf + "."):
            return gg + hf_name[len(hf) :]
    _, _, layer, *module, suffix = hf_name.split(".")
    return f"blk.{layer}.{HF_TO_GGUF['.'.join(module)]}.{suffix}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's Q/K row order
    shape = weight.shape
    return (
        weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _write_gguf(path: Path, arch: str, config: Any, state: dict[str, torch.Tensor]) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(getattr(config, "head_dim", None) or 8)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(3)
    for name, tensor in state.items():
        weight = tensor.detach().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            weight = _permute(weight, heads)
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_converted_gguf_reproduces_model(arch, tmp_path, monkeypatch, prefill_logits) -> None:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.copy_(param + 0.2 * torch.randn_like(param))
    state = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    if not hf_model.config.tie_word_embeddings:
        state["lm_head.weight"] = hf_model.lm_head.weight
    _write_gguf(tmp_path / "m.gguf", arch, hf_model.config, state)
    monkeypatch.setattr(gguf_convert, "save_tokenizer", lambda gguf_path, out: None)

    out = gguf_convert.convert_gguf(tmp_path / "m.gguf", tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [f"{arch.capitalize()}ForCausalLM"]
    assert config["tie_word_embeddings"] == hf_model.config.tie_word_embeddings
    assert config["eos_token_id"] == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".converted")] == []
    model = load_model(out, torch.float32, torch.device("cpu"), "torch")
    tokens = [5, 9, 33, 2, 61, 17, 40]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(prefill_logits(model, tokens), expected, atol=1e-4, rtol=1e-4)
