"""Convert a llama.cpp GGUF file into an HF-style directory kvflow (and transformers) load.

    model.gguf ──GGUFReader──▶ metadata ──▶ config.json, generation_config.json
                          └──▶ tensors ──dequantize, rename, un-permute──▶ model.safetensors
                                      └──Q8_0/Q4_0/Q4_1 blocks, un-permuted──▶ gguf_blocks/
    transformers' GGUF tokenizer reader ──▶ tokenizer.json, tokenizer_config.json, ...

Dequantized weights are stored as float32, so the directory holds exactly the values the
GGUF encodes whatever dtype the model later runs in. The blocks of the formats the CPU
block kernels read are kept too (gguf_blocks/blocks.safetensors, see block_weights.py):
a float32 model reads them instead of its float32 weights at small batch. llama.cpp
permutes the rows of the Q and K projections of llama-arch models (interleaved rotary
pairs); we undo it, as transformers' GGUF loader does. The output appears atomically: everything is written to
a temporary sibling directory which is renamed into place at the end, so a crash never
leaves a half-written cache and concurrent converters agree on one result.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.block_weights import BLOCK_FORMATS, BLOCKS_FILE

# llama.cpp architecture -> (HF model_type, HF architecture class).
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# GGUF metadata key (after "<arch>.") -> HF config field.
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

TOKEN_ID_KEYS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture_of(reader: Any) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})"
        )
    return str(arch)


def _rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
    scaling: dict[str, Any] = {"rope_type": kind}
    scaling["factor"] = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def config_kwargs(reader: Any) -> dict[str, Any]:
    """HF config fields read from the GGUF metadata (model_type and architectures included)."""
    arch = architecture_of(reader)
    model_type, hf_class = ARCHITECTURES[arch]
    kwargs: dict[str, Any] = {"model_type": model_type, "architectures": [hf_class]}
    for key, hf_key in CONFIG_KEYS.items():
        value = _field(reader, f"{arch}.{key}")
        if isinstance(value, list):
            raise UnsupportedModelError(f"per-layer GGUF metadata {arch}.{key} is not supported")
        if value is not None:
            kwargs[hf_key] = value
    kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
    if "head_dim" not in kwargs:
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if "vocab_size" not in kwargs:
        kwargs["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    for hf_key, gguf_key in TOKEN_ID_KEYS.items():
        value = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if value is not None:
            kwargs[hf_key] = int(value)
    kwargs["rope_scaling"] = _rope_scaling(reader, arch)
    kwargs["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    kwargs["dtype"] = "float32"
    return kwargs


def hf_tensor_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF parameter name (e.g. blk.3.attn_q.weight -> model.layers.3....)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in BLOCK_TENSORS:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{BLOCK_TENSORS[kind]}.{suffix}"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head it interleaves the two rotary halves
    (rows 0, D/2, 1, D/2+1, ...); HF's neox layout keeps halves contiguous."""
    rows_per_half = weight.shape[0] // num_heads // 2
    heads = weight.reshape(num_heads, rows_per_half, 2, *weight.shape[1:])
    return heads.swapaxes(1, 2).reshape(weight.shape)


class ConvertedTensor(NamedTuple):
    name: str  # HF parameter name
    weight: torch.Tensor  # float32, the values the GGUF encodes
    block_format: str | None  # GGUF type when the CPU block kernels can read the blocks
    blocks: torch.Tensor | None  # uint8 [rows, bytes per row], the GGUF blocks, HF row order


def converted_tensors(reader: Any, config: dict[str, Any]) -> Iterator[ConvertedTensor]:
    """Every GGUF tensor dequantized (and for block formats the CPU kernels read, its raw
    blocks too), renamed and in HF row order, with a progress bar."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    llama_arch = architecture_of(reader) == "llama"
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor"):
        if tensor.name == "rope_freqs.weight":
            raise UnsupportedModelError(
                "GGUF rope frequency factors (rope_freqs) are not supported"
            )
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = weight.reshape(shape)
        kept = tensor.tensor_type.name in BLOCK_FORMATS and len(shape) == 2
        block_format = tensor.tensor_type.name if kept else None
        blocks = np.asarray(tensor.data) if kept else None
        projection = name.split(".")[-2]
        if llama_arch and projection in heads:
            weight = unpermute_rows(weight, heads[projection])
            blocks = None if blocks is None else unpermute_rows(blocks, heads[projection])
        if not (weight.flags.writeable and weight.flags.c_contiguous):
            weight = np.array(weight, order="C")  # unquantized tensors are read-only mmap views
        yield ConvertedTensor(
            name,
            torch.from_numpy(weight),
            block_format,
            None if blocks is None else torch.from_numpy(np.array(blocks, order="C")),
        )


def save_tokenizer(gguf_path: Path, out: Path) -> None:
    """The GGUF's tokenizer (vocab, merges, special tokens, chat template) as HF files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(out)


def _write_directory(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    reader = GGUFReader(gguf_path)
    kwargs = config_kwargs(reader)
    config = AutoConfig.for_model(**kwargs)
    config.save_pretrained(out)
    token_ids = {key: kwargs[key] for key in TOKEN_ID_KEYS if key in kwargs}
    GenerationConfig(**token_ids).save_pretrained(out)
    weights, blocks, formats = {}, {}, {}
    for tensor in converted_tensors(reader, kwargs):
        weights[tensor.name] = tensor.weight
        if tensor.blocks is not None and tensor.block_format is not None:
            blocks[tensor.name], formats[tensor.name] = tensor.blocks, tensor.block_format
    save_file(weights, out / "model.safetensors", {"format": "pt"})
    if blocks:  # safetensors metadata: HF name -> GGUF type
        (out / BLOCKS_FILE).parent.mkdir()
        save_file(blocks, out / BLOCKS_FILE, formats)
    save_tokenizer(gguf_path, out)
    # mkdtemp made the directory private; the cache holds public weights, readable by all.
    for path in (out, *out.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write the HF directory of `gguf_path` at `out_dir` unless it exists; return `out_dir`."""
    if out_dir.is_dir():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_directory(gguf_path, tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise  # a real failure, not another converter winning the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
