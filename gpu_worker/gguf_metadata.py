"""Read a GGUF file's metadata and tensor list the way the converter needs them.

`Metadata` wraps gguf.GGUFReader: `get("attention.sliding_window")` reads the key under
the file's architecture prefix (`gemma2.attention.sliding_window`), `field` reads any
full key, and `layers_with` says which blocks hold a tensor kind (a Qwen MoE layer is
one with a router, `ffn_gate_inp`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class Metadata:
    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.arch = str(self.field("general.architecture"))
        self.tensor_names = {tensor.name for tensor in reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, e.g. get("block_count") reads `qwen3moe.block_count`."""
        return self.field(f"{self.arch}.{key}", default)

    def block_count(self) -> int:
        return int(self.get("block_count"))

    def layers_with(self, kind: str) -> list[int]:
        return [
            i for i in range(self.block_count()) if f"blk.{i}.{kind}.weight" in self.tensor_names
        ]

    def tensor_values(self, name: str) -> np.ndarray:
        """A (small, float) tensor's values, dequantized: e.g. Phi-3's rope factors."""
        from gguf.quants import dequantize

        tensor = next(t for t in self.reader.tensors if t.name == name)
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).ravel()
