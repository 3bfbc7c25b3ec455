"""The read roof of a model's own weights: how fast this process reads them, now.

A one-row decode step reads every weight once, so its ceiling is the rate at which the
CPU streams those bytes from DRAM. On a shared VM that rate is not one number: the same
2-vCPU guest read 33 GB/s in one process and 50 GB/s in the next (where the host placed
the pages), and moved between sittings. A calibration taken elsewhere (another buffer,
another hour) is then no roof for a step. This one is taken on the very pages the steps
read, right after they ran: a pass of torch's max over each weight tensor (as 32-bit
integers: a reduction that keeps up with DRAM, within 2% of a hand-written AVX-512 read
loop), best of `repeats`. The decode steps' bytes/s over it is the share of the
achievable read rate they reach.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every distinct CPU tensor the model holds: parameters, buffers, and the packed
    weights layers keep beside them (tensors or dataclasses of tensors, one level)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in _held(module):
            # (oneDNN's packed weights are opaque, with no storage to read: left out)
            if tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.numel():
                seen.setdefault(tensor.data_ptr(), tensor)
    return list(seen.values())


def _held(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=False)
    yield from module.buffers(recurse=False)
    for name, value in vars(module).items():
        if "cache" in name:  # an attention layer's KV cache view: not a weight
            continue
        if isinstance(value, torch.Tensor):
            yield value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                inner = getattr(value, field.name)
                if isinstance(inner, torch.Tensor):
                    yield inner


def read_pass_bytes_per_s(tensors: list[torch.Tensor], repeats: int = 3) -> tuple[int, float]:
    """(bytes read, best bytes/s) of one pass over `tensors` (contiguous ones)."""
    words = [_as_words(t) for t in tensors if t.is_contiguous()]
    nbytes = sum(w.numel() * w.element_size() for w in words)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms the TLB and the threads
        start = time.perf_counter()
        for word in words:
            word.max()
        best = min(best, time.perf_counter() - start)
    return nbytes, nbytes / best if nbytes else 0.0


def _as_words(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.view(torch.int32) if flat.numel() % 4 == 0 else flat


def model_read_roof(engine: Any) -> dict[str, float] | None:
    """The engine's model weights' read pass (bytes, GB/s), or None when the model is
    not in this process (tensor/pipeline parallel workers) or not on the CPU."""
    runner = getattr(getattr(engine, "executor", None), "runner", None)
    if runner is None or runner.device.type != "cpu":
        return None
    nbytes, rate = read_pass_bytes_per_s(weight_tensors(runner.model))
    return {"weight_bytes": nbytes, "read_gb_per_s": round(rate / 1e9, 2)}
