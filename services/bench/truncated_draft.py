"""A self-speculative draft model: the target's first N decoder layers, its embedding,
final norm and LM head, as an HF directory (`kvflow bench spec-decode --draft-layers N`).

It shares the target's tokenizer by construction and costs about N / L of a target
step, so it is the draft model any model can bring. Its acceptance depends on how
much of the prediction the first layers already make (docs/benchmarks.md reports it).
A converted GGUF's quantized blocks (gguf_blocks/) are kept for the kept layers, so
the draft reads the same 4-5x smaller weights as the target on CPU.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_WEIGHTS = "model.safetensors"
_BLOCKS = Path("gguf_blocks") / "blocks.safetensors"


def truncated_copy(src: Path, dst: Path, num_layers: int) -> Path:
    """Write (once) the first `num_layers` layers of the model in `src` to `dst`."""
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers < int(config["num_hidden_layers"]):
        raise ValueError(f"need 1 <= num_layers < {config['num_hidden_layers']}")
    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in src.iterdir():  # tokenizer, chat template, generation config
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, tmp / path.name)
    config["num_hidden_layers"] = num_layers
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tensors(src / _WEIGHTS, tmp / _WEIGHTS, num_layers)
    if (src / _BLOCKS).is_file():
        (tmp / _BLOCKS).parent.mkdir()
        _copy_tensors(src / _BLOCKS, tmp / _BLOCKS, num_layers)
    tmp.rename(dst)
    return dst


def _copy_tensors(src: Path, dst: Path, num_layers: int) -> None:
    """The tensors of layers below `num_layers` and of no layer; metadata kept (the
    blocks file maps tensor names to formats there)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata() or {}
        kept = {}
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            match = _LAYER.search(name)
            if match is None or int(match.group(1)) < num_layers:
                kept[name] = f.get_tensor(name)
    names = set(kept)
    metadata = {k: v for k, v in metadata.items() if k in names or k == "format"}
    save_file(kept, str(dst), metadata=metadata)
