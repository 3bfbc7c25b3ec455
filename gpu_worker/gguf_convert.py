"""Convert a llama.cpp GGUF file into an HF-style directory kvflow (and transformers) load.

    model.gguf ──GGUFReader──▶ metadata ──▶ config.json, generation_config.json   (gguf_config.py)
                          └──▶ tensors ──dequantize, rename, un-permute──▶ model.safetensors
                                      │                         (or 4 GiB shards + index)
                                      └──Q8_0/Q4_0/Q4_1 blocks, HF row order──▶ gguf_blocks/
    transformers' GGUF tokenizer reader ──▶ tokenizer.json, tokenizer_config.json, ...

What differs between llama.cpp architectures (tensor names, permuted Q/K rows, Gemma's
shifted norms, stacked experts, the config fields) is one row per architecture in
gguf_archs.py; the tensor side is gguf_tensors.py. Dequantized weights are stored as
float32, so the directory holds exactly the values the GGUF encodes whatever dtype the
model later runs in. The blocks of the formats the CPU block kernels read are kept too
(gguf_blocks/blocks.safetensors, see block_weights.py): a float32 model reads them
instead of its float32 weights at small batch. The output appears atomically: everything is written to
a temporary sibling directory which is renamed into place at the end, so a crash never
leaves a half-written cache and concurrent converters agree on one result.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kvflow.gpu_worker.block_weights import BLOCKS_FILE
from kvflow.gpu_worker.gguf_archs import arch_of
from kvflow.gpu_worker.gguf_config import TOKEN_ID_KEYS, config_kwargs
from kvflow.gpu_worker.gguf_metadata import Metadata
from kvflow.gpu_worker.gguf_tensors import converted_tensors
from kvflow.gpu_worker.weights import INDEX_FILE

SHARD_BYTES = 4 << 30  # float32 weights per safetensors file


def save_tokenizer(gguf_path: Path, out: Path) -> None:
    """The GGUF's tokenizer (vocab, merges, special tokens, chat template) as HF files.

    AutoTokenizer given only the file would read the model config from it with
    transformers' GGUF model loader, which knows fewer architectures than its tokenizer
    reader; so the class is picked here from the converted config's model_type, as
    AutoTokenizer picks it (no class registered: the generic tokenizers backend)."""
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    model_type = json.loads((out / "config.json").read_text())["model_type"]
    folder, name = str(gguf_path.parent), gguf_path.name
    if TOKENIZER_MAPPING_NAMES.get(model_type):
        tokenizer = AutoTokenizer.from_pretrained(
            folder, tokenizer_type=model_type, gguf_file=name, local_files_only=True
        )
    else:
        tokenizer = TokenizersBackend.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tokenizer.save_pretrained(out)


class ShardWriter:
    """Writes the float32 weights in files of about SHARD_BYTES each, so converting a
    large (mixture-of-experts) GGUF holds one shard in memory, not the whole model: one
    file is `model.safetensors`; more are `model-<n>.safetensors` plus the index
    (`model.safetensors.index.json`) transformers and weights.py read."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.pending and self.pending_bytes + tensor.nbytes > SHARD_BYTES:
            self._flush(f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors")
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes

    def _flush(self, file_name: str) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, self.out / file_name, {"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, file_name))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if not self.weight_map:  # everything fits one file
            self._flush("model.safetensors")
            return
        self._flush(f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors")
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


def _write_directory(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    reader = GGUFReader(gguf_path)
    metadata = Metadata(reader)
    arch = arch_of(metadata)
    kwargs = config_kwargs(metadata, arch)
    config = AutoConfig.for_model(**kwargs)
    config.save_pretrained(out)
    token_ids = {key: kwargs[key] for key in TOKEN_ID_KEYS if key in kwargs}
    GenerationConfig(**token_ids).save_pretrained(out)
    shards, blocks, formats = ShardWriter(out), {}, {}
    for tensor in converted_tensors(reader, arch, kwargs):
        shards.add(tensor.name, tensor.weight)
        if tensor.blocks is not None and tensor.block_format is not None:
            blocks[tensor.name], formats[tensor.name] = tensor.blocks, tensor.block_format
    shards.close()
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
