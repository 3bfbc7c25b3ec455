"""Build a model from an HF directory (see model_files.py) with its weights loaded."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvflow.gpu_worker.model_files import set_offline


def load_hf_config(model_dir: Path) -> Any:
    """The transformers config of an HF directory (no network access)."""
    set_offline()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters are created directly in `dtype` (no float32 copy of a big model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: Path, dtype: torch.dtype, device: torch.device, attention_backend: str
) -> nn.Module:
    """The model of `model_dir` on `device` in `dtype`, weights loaded, in eval mode."""
    from kvflow.gpu_worker.attention.backend import get_attention_backend
    from kvflow.gpu_worker.models.registry import get_model_class
    from kvflow.gpu_worker.weights import iterate_safetensors, load_weights

    config = load_hf_config(model_dir)
    model_class = get_model_class(getattr(config, "architectures", None))
    backend = get_attention_backend(attention_backend)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config, backend)  # type: ignore[call-arg]
    load_weights(model, iterate_safetensors(model_dir))
    return model.eval().requires_grad_(False)
