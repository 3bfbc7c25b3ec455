"""A random-weight checkpoint on disk from a config.json, for peers that need files.

kvflow and vLLM run a config.json with `--load-format dummy`; llama.cpp converts a
checkpoint into GGUF and has no such mode. This writes one: every tensor the model of
`config.json` has (names and shapes from the model built on torch's meta device, tied
weights once), drawn by torch's generator as gpu_worker/dummy_weights.py draws them
(matrices N(0, 1/in_features), norms 1, biases 0: activations keep their scale), in
safetensors shards with the index transformers reads, next to the config and tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

SHARD_BYTES = 4 << 30  # transformers' default max_shard_size is 5 GB; stay under it
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
           "chat_template.jinja")  # fmt: skip


def parameter_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every parameter of the model `model_dir` describes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def dummy_tensor(name: str, shape: tuple[int, ...], dtype: Any, generator: Any) -> Any:
    import torch

    if len(shape) == 1:
        return torch.full(shape, 1.0 if "norm" in name else 0.0, dtype=dtype)
    tensor = torch.empty(shape, dtype=dtype)
    return tensor.normal_(0.0, shape[-1] ** -0.5, generator=generator)


def write_dummy_checkpoint(
    model_dir: Path, out_dir: Path, dtype: str = "bfloat16", seed: int = 0
) -> Path:
    """`out_dir` holding model_dir's config/tokenizer + random safetensors; written once
    (a complete directory is reused)."""
    import torch
    from safetensors.torch import save_file

    if (out_dir / "model.safetensors.index.json").is_file():
        return out_dir
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in _COPIED:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, partial / name)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    shard_bytes, total = 0, 0
    shapes = parameter_shapes(model_dir)

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(partial / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        tensor = dummy_tensor(name, shape, getattr(torch, dtype), generator)
        size = tensor.numel() * tensor.element_size()
        if shard_bytes + size > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes, total = shard_bytes + size, total + size
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return out_dir
