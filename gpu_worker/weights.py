"""Load an HF safetensors checkpoint into a kvflow model through per-parameter loaders.

Checkpoint names are model parameter names, except for matrices the model packs
(`packed_modules_mapping`, e.g. `...self_attn.k_proj.weight` -> `...qkv_proj.weight`
shard "k"), or where the model maps names itself (`checkpoint_target(name)` -> (parameter
name, shard_id), e.g. a mixture of experts stacking per-expert tensors). A checkpoint
that stores a packed matrix fused (Phi-3's qkv_proj, gate_up_proj) is cut into its parts
by the model's `split_checkpoint_tensor`. Loading is strict both ways: a checkpoint
tensor with no parameter is an error, and so is a parameter (or a shard of a packed one)
that no tensor filled, named as the checkpoint tensor that was missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvflow.errors import ModelNotFoundError, UnsupportedModelError
from kvflow.gpu_worker.layers.linear import copy_checked_loader

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those the index names if there is one, else every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on CPU) for every tensor of the checkpoint, file by file."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield name, f.get_tensor(name)


def _skipped(name: str, tied: bool) -> bool:
    # Old checkpoints store RoPE's inv_freq (we recompute it); tied models may store a
    # copy of the embedding as lm_head.weight, which is the same tensor for us.
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def packed_target(name: str, mapping: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """(parameter name, shard_id) of checkpoint tensor `name` (see the module docstring)."""
    for checkpoint_name, (packed_name, shard_id) in mapping.items():
        if f".{checkpoint_name}." in name:
            return name.replace(f".{checkpoint_name}.", f".{packed_name}."), shard_id
    return name, None


def checkpoint_name(param_name: str, shard_id: Any, mapping: dict[str, tuple[str, Any]]) -> str:
    """The checkpoint tensor that fills `param_name`'s shard `shard_id` (packed_target's inverse)."""
    for checkpoint, (packed, packed_shard) in mapping.items():
        if shard_id == packed_shard and f".{packed}." in param_name:
            return param_name.replace(f".{packed}.", f".{checkpoint}.")
    return param_name


def _split(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    split = getattr(model, "split_checkpoint_tensor", None)
    for name, tensor in weights:
        if split is None:
            yield name, tensor
        else:
            yield from split(name, tensor)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every checkpoint tensor into its parameter; raise if anything is left over."""
    params = dict(model.named_parameters())
    mapping: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    elsewhere = getattr(model, "skips_weight", None)  # a pipeline stage's other layers
    target_of = getattr(model, "checkpoint_target", None)
    loaded: set[tuple[str, Any]] = set()
    for name, tensor in _split(model, weights):
        if _skipped(name, tied) or (elsewhere is not None and elsewhere(name)):
            continue
        if target_of is not None:
            target, shard_id = target_of(name)
        else:
            target, shard_id = packed_target(name, mapping)
        param = params.get(target)
        if param is None:
            raise UnsupportedModelError(f"checkpoint tensor {name!r} matches no model parameter")
        loader = getattr(param, "weight_loader", copy_checked_loader)
        try:
            with torch.no_grad():
                loader(param, tensor, shard_id)
        except ValueError as error:  # a shape that does not fit: name the tensor
            raise UnsupportedModelError(f"checkpoint tensor {name!r}: {error}") from error
        loaded.add((target, shard_id))
    missing = [
        name
        if shard_id is None
        else f"{checkpoint_name(name, shard_id, mapping)} -> {name} (shard {shard_id!r})"
        for name, param in params.items()
        for shard_id in getattr(param, "shard_ids", (None,))
        if (name, shard_id) not in loaded
    ]
    if missing:
        raise UnsupportedModelError(f"checkpoint lacks tensors: {missing}")
