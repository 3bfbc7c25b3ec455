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
    return layer_subset_copy(src, dst, list(range(num_layers)))


def layer_subset_copy(src: Path, dst: Path, layers: list[int]) -> Path:
    """Write (once) the model in `src` with only `layers` (ascending), renumbered."""
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not layers or layers != sorted(set(layers)) or layers[0] < 0 or len(layers) >= total:
        raise ValueError(f"need ascending layers, fewer than {total}")
    if layers[-1] >= total:
        raise ValueError(f"the model has {total} layers")
    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in src.iterdir():  # tokenizer, chat template, generation config
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, tmp / path.name)
    config["num_hidden_layers"] = len(layers)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    renumber = {old: new for new, old in enumerate(layers)}
    _copy_tensors(src / _WEIGHTS, tmp / _WEIGHTS, renumber)
    if (src / _BLOCKS).is_file():
        (tmp / _BLOCKS).parent.mkdir()
        _copy_tensors(src / _BLOCKS, tmp / _BLOCKS, renumber)
    tmp.rename(dst)
    return dst


def _copy_tensors(src: Path, dst: Path, renumber: dict[int, int]) -> None:
    """The tensors of the kept layers (renamed to their new index) and of no layer;
    metadata kept and renamed alike (the blocks file maps tensor names to formats)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    def new_name(name: str) -> str | None:
        match = _LAYER.search(name)
        if match is None:
            return name
        layer = int(match.group(1))
        if layer not in renumber:
            return None
        return f"{name[: match.start(1)]}{renumber[layer]}{name[match.end(1) :]}"

    with safe_open(str(src), framework="pt") as f:
        old_metadata = f.metadata() or {}
        kept, metadata = {}, {}
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            renamed = new_name(name)
            if renamed is not None:
                kept[renamed] = f.get_tensor(name)
                if name in old_metadata:
                    metadata[renamed] = old_metadata[name]
    if "format" in old_metadata:
        metadata["format"] = old_metadata["format"]
    save_file(kept, str(dst), metadata=metadata)
