"""The read roof of a model's own weights (`kvflow bench` roofline section)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvflow.metrics.weight_read import read_pass_bytes_per_s, weight_tensors


@dataclass(frozen=True)
class Packed:
    data: torch.Tensor
    rows: int


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 32, bias=True)
        self.packed_weight = Packed(torch.ones(32, 64), 32)  # beside the parameters
        self.kv_cache = torch.zeros(1000, 64)  # not a weight
        self.shared = self.linear.weight  # the same tensor twice: counted once


def test_weight_tensors_are_parameters_buffers_and_packed_ones_once() -> None:
    model = nn.Sequential(Layer(), Layer())
    model.register_buffer("scale", torch.ones(7))
    tensors = weight_tensors(model)
    expected = 2 * (64 * 32 + 32 + 64 * 32) + 7
    assert sum(t.numel() for t in tensors) == expected
    assert not any(t.shape == (1000, 64) for t in tensors)


def test_a_read_pass_reads_every_byte_once() -> None:
    tensors = [torch.ones(1024, 256), torch.ones(3, dtype=torch.uint8), torch.ones(5).t()]
    nbytes, rate = read_pass_bytes_per_s(tensors, repeats=1)
    assert nbytes == 1024 * 256 * 4 + 3 + 5 * 4 and rate > 0
