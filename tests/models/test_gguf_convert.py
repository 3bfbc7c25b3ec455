"""GGUF -> HF conversion of synthetic llama / qwen2 / qwen3 files written like llama.cpp.

A tiny random HF model is written by tests/gguf_writer.py under llama.cpp's tensor names
(Q/K rows permuted for the llama arch, as convert_hf_to_gguf does), converted back, and
loaded by kvflow: its logits must equal the original model's. Tensors are F32, so the
round trip is exact; the tokenizer step is covered by the embedded-model test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_writer import write_gguf
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from kvflow.gpu_worker import gguf_convert
from kvflow.gpu_worker.block_weights import BLOCKS_FILE
from kvflow.gpu_worker.model_loader import load_model
from kvflow.kernels.cpu import block_linear

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


# (arch, shard size): a small size splits the float32 weights over several files + index.
CASES = [(arch, None) for arch in sorted(CONFIGS)] + [("qwen2", 8192)]


@pytest.mark.parametrize(("arch", "shard_bytes"), CASES)
def test_converted_gguf_reproduces_model(
    arch, shard_bytes, tmp_path, monkeypatch, prefill_logits
) -> None:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.copy_(param + 0.2 * torch.randn_like(param))
    state = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    if not hf_model.config.tie_word_embeddings:
        state["lm_head.weight"] = hf_model.lm_head.weight
    tensors = {name: t.detach().numpy() for name, t in state.items()}
    write_gguf(tmp_path / "m.gguf", arch, hf_model.config, tensors)
    monkeypatch.setattr(gguf_convert, "save_tokenizer", lambda gguf_path, out: None)
    if shard_bytes is not None:
        monkeypatch.setattr(gguf_convert, "SHARD_BYTES", shard_bytes)

    out = gguf_convert.convert_gguf(tmp_path / "m.gguf", tmp_path / "converted")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(shards) > 2) == (shard_bytes is not None), shards
    assert (out / "model.safetensors.index.json").is_file() == (shard_bytes is not None)
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
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # transformers reads it too
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(torch.tensor([tokens])).logits[0], expected)


def _quantized_llama(tmp_path: Path, monkeypatch) -> Path:
    """A tiny llama GGUF whose matrices are Q4_1, Q4_0 and Q8_0 blocks, converted."""
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    state = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    formats = {name: "Q4_1" for name, t in state.items() if t.dim() == 2}
    formats["model.embed_tokens.weight"] = "Q8_0"  # tied: the LM head reads it
    formats["model.layers.1.self_attn.o_proj.weight"] = "Q4_0"
    formats["model.layers.1.mlp.up_proj.weight"] = "Q8_0"  # gate stays Q4_1: mixed layer
    tensors = {name: t.detach().numpy() for name, t in state.items()}
    write_gguf(tmp_path / "q.gguf", "llama", config, tensors, formats)
    monkeypatch.setattr(gguf_convert, "save_tokenizer", lambda gguf_path, out: None)
    return gguf_convert.convert_gguf(tmp_path / "q.gguf", tmp_path / "converted")


@pytest.mark.native(block_linear.available())
def test_quantized_gguf_layers_read_their_blocks(tmp_path, monkeypatch, prefill_logits) -> None:
    out = _quantized_llama(tmp_path, monkeypatch)
    assert (out / BLOCKS_FILE).is_file()
    model = load_model(out, torch.float32, torch.device("cpu"), "torch")
    with_blocks = sorted(n for n, m in model.named_modules() if getattr(m, "blocks", None))
    expected = [
        f"model.layers.{i}.{layer}"
        for i in range(2)
        for layer in ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj")
        if (i, layer) != (1, "mlp.gate_up_proj")  # gate Q4_1, up Q8_0: no single format
    ]
    assert with_blocks == sorted([*expected, "lm_head"])
    assert model.model.layers[1].self_attn.o_proj.blocks.format == "Q4_0"
    assert model.lm_head.blocks.format == "Q8_0"

    # Seven tokens: every matmul of the step reads blocks, and the logits are those of
    # the dequantized float32 model, as transformers computes them from the same directory.
    calls: list[int] = []
    original = block_linear.block_linear
    monkeypatch.setattr(block_linear, "block_linear", lambda *a: calls.append(1) or original(*a))
    tokens = [5, 9, 33, 2, 61, 17, 40]
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected_logits = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(prefill_logits(model, tokens), expected_logits, atol=1e-4, rtol=1e-4)
    assert len(calls) == len(with_blocks)


@pytest.mark.native(block_linear.available())
def test_blocks_that_do_not_reproduce_the_weights_are_not_used(tmp_path, monkeypatch, caplog):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out = _quantized_llama(tmp_path, monkeypatch)
    with safe_open(str(out / BLOCKS_FILE), framework="pt") as f:
        metadata = f.metadata()
    blocks = load_file(out / BLOCKS_FILE)
    blocks["model.layers.0.self_attn.o_proj.weight"][3, 7] ^= 0xFF  # one corrupted byte
    save_file(blocks, out / BLOCKS_FILE, metadata)
    model = load_model(out, torch.float32, torch.device("cpu"), "torch")
    assert model.model.layers[0].self_attn.o_proj.blocks is None
    assert model.model.layers[1].self_attn.o_proj.blocks is not None
    assert "model.layers.0.self_attn.o_proj do not reproduce" in caplog.text
    # bfloat16 reads them too where its weight is their float32 value rounded: the same
    # check, so not the corrupted layer.
    bf16 = load_model(out, torch.bfloat16, torch.device("cpu"), "torch")
    assert bf16.model.layers[0].self_attn.o_proj.blocks is None
    o_proj = bf16.model.layers[1].self_attn.o_proj
    assert o_proj.blocks is not None
    # A decode row of the bf16 model reads them: the unrounded weights, one rounding.
    x = torch.randn(1, o_proj.blocks.in_features, dtype=torch.bfloat16)
    assert torch.equal(o_proj(x), block_linear.block_linear(x.float(), o_proj.blocks).bfloat16())
