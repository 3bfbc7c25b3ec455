"""A GGUF file's tensors as Hugging Face checkpoint tensors, undoing llama.cpp's conventions.

Per tensor, by the architecture's row (gguf_archs.py):

    blk.N.<kind>.weight ──rename──▶ model.layers.N.<module>.weight
    ffn_{gate,up,down}_exps [E, rows, cols] ──split──▶ E tensors <block>.experts.<e>.<proj>
    attn_q / attn_k (permuted_qk) ──un-permute rows──▶ HF's rotate-half order
    *norm (norm_shift) ──minus the shift──▶ Gemma's w of (1 + w)
    row_vectors [n] ──▶ [1, n]
    hooks (gguf_joins.py): one or two GGUF tensors ──combine──▶ one HF tensor

Every tensor is dequantized to float32 (the values the GGUF encodes). The raw blocks of
a matrix in a format the CPU block kernels read (block_weights.py) come along, in HF row
order; stacked experts are dequantized only (the fused MoE kernels read float weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.block_weights import BLOCK_FORMATS
from kvflow.gpu_worker.gguf_archs import GLOBAL_TENSORS, ExpertNames, GGUFArch
from kvflow.gpu_worker.gguf_joins import TensorHook
from kvflow.gpu_worker.gguf_metadata import BLOCK_NAME
from kvflow.gpu_worker.gguf_rope import ROPE_FREQS

EXPERT_KINDS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


def hf_tensor_name(gguf_name: str, arch: GGUFArch) -> str:
    """GGUF tensor name -> HF parameter name (e.g. blk.3.attn_q.weight -> model.layers.3....)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    match = BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in arch.block_tensors:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{arch.block_tensors[kind]}.{suffix}"


def expert_tensor_name(layer: int, expert: int, proj: str, names: ExpertNames) -> str:
    """HF name of one expert's projection (`proj`: gate, up or down)."""
    return f"model.layers.{layer}.{names.block}.experts.{expert}.{getattr(names, proj)}.weight"


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


def _owned(array: np.ndarray) -> torch.Tensor:
    """A writable, contiguous copy where needed (unquantized tensors are read-only mmap views)."""
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = np.array(array, order="C")
    return torch.from_numpy(array)


def _experts(tensor: Any, weight: np.ndarray, names: ExpertNames) -> Iterator[ConvertedTensor]:
    match = BLOCK_NAME.fullmatch(tensor.name)
    assert match is not None
    layer, proj = int(match.group(1)), EXPERT_KINDS[match.group(2)]
    for expert, matrix in enumerate(weight):
        yield ConvertedTensor(
            expert_tensor_name(layer, expert, proj, names), _owned(matrix.copy()), None, None
        )


def _dequantized(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first
    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def _hooked(
    layer: str, kind: str, hook: TensorHook, by_name: dict[str, Any]
) -> Iterator[ConvertedTensor]:
    """The hook's HF tensor, made when its first GGUF tensor comes (the others are read
    then, by name, and skipped when they come)."""
    if kind != hook.kinds[0]:
        return
    names = [f"blk.{layer}.{part}.{hook.suffix}" for part in hook.kinds]
    missing = [name for name in names if name not in by_name]
    if missing:
        raise UnsupportedModelError(f"GGUF tensor {names[0]!r} comes without {missing}")
    weight = hook.combine([_dequantized(by_name[name]) for name in names])
    yield ConvertedTensor(f"model.layers.{layer}.{hook.target}", _owned(weight), None, None)


def _convert(tensor: Any, arch: GGUFArch, heads: dict[str, int]) -> Iterator[ConvertedTensor]:
    weight = _dequantized(tensor)
    shape = weight.shape
    match = BLOCK_NAME.fullmatch(tensor.name)
    kind = match.group(2) if match else ""
    if kind in EXPERT_KINDS and arch.experts is not None:
        yield from _experts(tensor, weight, arch.experts)
        return
    name = hf_tensor_name(tensor.name, arch)
    kept = tensor.tensor_type.name in BLOCK_FORMATS and len(shape) == 2
    blocks = np.asarray(tensor.data) if kept else None
    projection = name.split(".")[-2]
    if arch.permuted_qk and projection in heads:
        weight = unpermute_rows(weight, heads[projection])
        blocks = None if blocks is None else unpermute_rows(blocks, heads[projection])
    if arch.norm_shift and tensor.name.endswith("norm.weight"):
        weight = weight - np.float32(arch.norm_shift)
    if kind in arch.row_vectors:
        weight = weight.reshape(1, -1)
    yield ConvertedTensor(
        name,
        _owned(weight),
        tensor.tensor_type.name if kept else None,
        None if blocks is None else torch.from_numpy(np.array(blocks, order="C")),
    )


def converted_tensors(
    reader: Any, arch: GGUFArch, config: dict[str, Any]
) -> Iterator[ConvertedTensor]:
    """Every GGUF weight dequantized (and for block formats the CPU kernels read, its raw
    blocks too), renamed and in HF layout, with a progress bar."""
    from tqdm import tqdm

    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    hooks = {(kind, hook.suffix): hook for hook in arch.hooks for kind in hook.kinds}
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor"):
        if tensor.name in arch.config_tensors or tensor.name == ROPE_FREQS:
            continue  # read into config.json (gguf_config.py)
        match = BLOCK_NAME.fullmatch(tensor.name)
        hook = hooks.get((match.group(2), match.group(3))) if match else None
        if match is not None and hook is not None:
            yield from _hooked(match.group(1), match.group(2), hook, by_name)
        else:
            yield from _convert(tensor, arch, heads)
