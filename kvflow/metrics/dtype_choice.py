"""`dtype=auto` on CPU: bfloat16 or float32, chosen by measuring this machine's matmuls.

CPU flags do not say which dtype is faster: a Xeon with AVX512-BF16 and no AMX runs
bf16 matmuls at about half its float32 rate, while an AMX Xeon, or a Zen 5 EPYC whose
AVX512-BF16 is full width, runs them 4-5x faster than float32. So the choice times both,
interleaved so that a noisy neighbour slows both alike, at the shape of a
transformer MLP projection, and takes bfloat16 only when it is clearly faster
(`BF16_MIN_SPEEDUP`): at a tie float32 wins, because it is exact where bf16 rounds
(docs/design.md, "Where kvflow rounds in bf16").

The result is cached in <cache>/dtype_choice.json per CPU model and thread count, so the
launcher reads it without importing torch after the first start on a machine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvflow.cache_dir import cpu_model, default_cache_dir, read_json, write_json_atomically

logger = logging.getLogger(__name__)

BF16_MIN_SPEEDUP = 1.2
# [tokens, hidden] @ [hidden, intermediate]: a 256-token prefill chunk through an MLP
# projection of a small model; big enough to reach the matmul's steady rate in ~5 ms.
MATMUL_SHAPE = (256, 1024, 2816)
_ROUNDS = 5
_BUDGET_S = 0.3


@dataclass(frozen=True)
class DTypeChoice:
    dtype: str  # "bfloat16" | "float32"
    float32_gflops: float
    bfloat16_gflops: float
    source: str  # "measured" | "cached"


def choose_cpu_dtype(cache_file: Path | None = None, threads: int | None = None) -> DTypeChoice:
    """The faster dtype on this CPU, from the cache or from a ~0.1 s measurement (~1.5 s where bf16 is emulated)."""
    cache_file = cache_file or default_cache_file()
    key = _cache_key(threads)
    cached = read_json(cache_file).get(key)
    if cached is not None:
        return DTypeChoice(
            cached["dtype"], cached["float32_gflops"], cached["bfloat16_gflops"], "cached"
        )
    choice = measure_cpu_dtype(threads)
    _store(cache_file, key, choice)
    logger.info(
        "dtype=auto: %s (matmul %.0f GFLOP/s float32, %.0f GFLOP/s bfloat16; cached in %s)",
        choice.dtype, choice.float32_gflops, choice.bfloat16_gflops, cache_file,
    )  # fmt: skip
    return choice


def measure_cpu_dtype(threads: int | None = None) -> DTypeChoice:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    m, k, n = MATMUL_SHAPE
    matmuls = {
        dtype: _layer_matmul(torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype))
        for dtype in (torch.float32, torch.bfloat16)
    }
    best = {dtype: float("inf") for dtype in matmuls}
    deadline = time.perf_counter() + _BUDGET_S
    for round_index in range(_ROUNDS + 1):  # round 0 warms up: page faults, kernel choice
        for dtype, matmul in matmuls.items():
            start = time.perf_counter()
            matmul()
            elapsed = time.perf_counter() - start
            if round_index > 0:
                best[dtype] = min(best[dtype], elapsed)
        if round_index > 0 and time.perf_counter() > deadline:
            break  # emulated bf16 (AVX2) runs at ~2 GFLOP/s: one round is decisive
    flops = 2 * m * k * n
    fp32, bf16 = flops / best[torch.float32] / 1e9, flops / best[torch.bfloat16] / 1e9
    return DTypeChoice(faster_dtype(fp32, bf16), fp32, bf16, "measured")


def _layer_matmul(x: Any, weight: Any) -> Callable[[], object]:
    """x @ weight.T as the worker's linear layers run it: on a weight packed once for
    oneDNN where torch can (kernels/cpu/packed_linear.py, which this core module may not
    import), else F.linear."""
    import torch
    import torch.nn.functional as F

    ops = torch.ops.mkldnn
    packable = (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and (x.dtype != torch.bfloat16 or ops._is_mkldnn_bf16_supported())
    )
    if not packable:
        return lambda: F.linear(x, weight)
    packed = ops._reorder_linear_weight(weight)
    return lambda: ops._linear_pointwise(x, packed, None, "none", [], "")


def faster_dtype(float32_gflops: float, bfloat16_gflops: float) -> str:
    return "bfloat16" if bfloat16_gflops >= BF16_MIN_SPEEDUP * float32_gflops else "float32"


def default_cache_file() -> Path:
    return default_cache_dir() / "dtype_choice.json"


def _cache_key(threads: int | None) -> str:
    # "packed": choices timed before the worker packed its weights are measured again.
    return f"{cpu_model()}|{threads or os.cpu_count()} threads|packed"


def _store(cache_file: Path, key: str, choice: DTypeChoice) -> None:
    data = read_json(cache_file)
    data[key] = {k: v for k, v in asdict(choice).items() if k != "source"}
    write_json_atomically(cache_file, data)
