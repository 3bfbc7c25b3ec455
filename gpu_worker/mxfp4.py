"""MXFP4 expert weights (the published gpt-oss checkpoints), dequantized as they are read.

A quantized tensor arrives as two checkpoint tensors, in any order:

    <name>_blocks  uint8 [E, R, G, 16]  32 FP4 (e2m1) codes per group of 32 values of a
                                        row, two per byte, the low nibble first
    <name>_scales  uint8 [E, R, G]      each group's power of two, biased by 127

    value = FP4[code] * 2 ** (scale - 127)   ->   [E, R, G * 32]

The rows R are the output features: the dequantized [E, out, in] is the transpose of the
bf16 checkpoints' [E, in, out] tensor, so it is handed on as that (a view) and loads as
a bf16 checkpoint's would. The experts then run in the model dtype (no FP4 kernels).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from kvflow.errors import UnsupportedModelError

# The 16 e2m1 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SUPPORTED = (None, "mxfp4")
_HALVES = ("_blocks", "_scales")


def check_quantization(config: Any) -> None:
    """Refuse, at start, a checkpoint quantized some way kvflow cannot read."""
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method = quantization.get("quant_method")
    if method not in SUPPORTED:
        raise UnsupportedModelError(
            f"checkpoint quantized with {method!r}: kvflow reads gpt-oss checkpoints in a "
            "float dtype or in MXFP4 (dequantized at load)"
        )


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, R, G, 16] codes and [E, R, G] scales -> [E, R, G * 32] in `dtype`, an expert at
    a time (the float32 intermediate of one expert, not of them all)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales are uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, rows, groups * 32, dtype=dtype)
    for e in range(experts):
        codes = blocks[e].to(torch.int64)
        values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)  # [R, G, 16, 2]
        exponents = scales[e].to(torch.int32) - 127  # [R, G]
        scaled = torch.ldexp(values.reshape(rows, groups, 32), exponents[..., None])
        out[e] = scaled.reshape(rows, groups * 32).to(dtype)
    return out


class Mxfp4Pairs:
    """Pairs each `_blocks` tensor with its `_scales` as the checkpoint streams by."""

    def __init__(self) -> None:
        self.waiting: dict[str, torch.Tensor] = {}  # a half whose partner is not read yet

    def take(
        self, name: str, tensor: torch.Tensor, dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as the bf16 checkpoint would hold it: an unquantized tensor as
        it is, a quantized one dequantized once both halves are in, else nothing yet."""
        half = next((h for h in _HALVES if name.endswith(h)), None)
        if half is None:
            yield name, tensor
            return
        base = name[: -len(half)]
        partner = base + (_HALVES[1] if half == _HALVES[0] else _HALVES[0])
        if partner not in self.waiting:
            self.waiting[name] = tensor
            return
        other = self.waiting.pop(partner)
        blocks, scales = (tensor, other) if half == "_blocks" else (other, tensor)
        try:
            values = dequantize(blocks, scales, dtype)
        except ValueError as error:
            raise UnsupportedModelError(f"checkpoint tensor {base!r}: {error}") from error
        yield base, values.transpose(1, 2)
