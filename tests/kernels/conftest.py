"""Kernel tests run everywhere: compiled on a CUDA GPU, interpreted on CPU otherwise.

TRITON_INTERPRET must be set before any kvflow kernel module is imported (triton picks
the interpreter when a kernel is decorated), hence at the top of this conftest.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

# Before any test module imports kvflow.kernels (nothing above does).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerances per dtype vs the fp32 torch references: fp32 kernels compute the same sums
# in another order; bf16 results may differ by one bf16 ulp after the final rounding.
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2},
}


@dataclass
class PagedBatch:
    """A step of requests over a random paged cache (see gpu_worker/attn_metadata.py)."""

    query: torch.Tensor  # [num_tokens + pad, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens + pad] int64, -1 for the padding tokens
    max_query_len: int
    max_seq_len: int

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def make_paged_batch(
    requests: list[tuple[int, int]],  # (seq_len, q_len) per request
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_pad_tokens: int = 0,
    seed: int = 0,
) -> PagedBatch:
    """Blocks are handed out in shuffled order; every cache slot that no request's context
    covers (spare blocks, tails of partial last blocks) holds NaN, so a kernel that reads
    or fails to mask one produces NaN instead of a plausible wrong number."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // block_size) for seq_len, _ in requests]
    num_blocks = sum(blocks_per_req) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(requests), max(blocks_per_req), dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    slots: list[int] = []
    for r, (seq_len, q_len) in enumerate(requests):
        blocks = [order.pop() for _ in range(blocks_per_req[r])]
        block_tables[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(seq_len):
            block, offset = blocks[pos // block_size], pos % block_size
            kv_cache[:, block, offset] = torch.randn(2, num_kv_heads, head_dim, generator=gen)
            if pos >= seq_len - q_len:
                slots.append(block * block_size + offset)
    num_tokens = len(slots) + num_pad_tokens
    q_lens = torch.tensor([q for _, q in requests])
    return PagedBatch(
        query=torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE),
        kv_cache=kv_cache.to(dtype).to(DEVICE),
        query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE),
        seq_lens=torch.tensor([s for s, _ in requests], dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.tensor(slots + [-1] * num_pad_tokens, dtype=torch.int64, device=DEVICE),
        max_query_len=int(q_lens.max()),
        max_seq_len=max(s for s, _ in requests),
    )


def quantize_paged_batch(batch: PagedBatch, dtype: torch.dtype) -> PagedBatch:
    """The batch with its cache quantized to `dtype` (kernels/kv_codec.py). Rows that no
    request's context covers stay traps: all their bytes are 0xFF, so their scale is NaN."""
    from kvflow.kernels import kv_codec  # here: kvflow is imported after TRITON_INTERPRET

    values = batch.kv_cache.float()
    uncovered = values.isnan().any(-1)
    rows = kv_codec.quantize_rows(values.nan_to_num(0.0), dtype)
    rows.view(torch.uint8)[uncovered] = 0xFF
    return dataclasses.replace(batch, kv_cache=rows)


# How a model's attention layer may hand this step's K/V to the kernels: views of the fused
# qkv output (row stride (H + 2 KH) D) or contiguous copies. Llama: K rotated in place (a
# view), V copied; Qwen3: K normed (a copy), V a view; both views when nothing copies.
KV_LAYOUTS = ("k_view_v_copy", "k_copy_v_view", "both_views")


def make_step_kv(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layout: str,
    seed: int = 7,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, KH, D], [num_tokens, KH, D])
    """Random (key, value) on DEVICE laid out as `layout` (one of KV_LAYOUTS)."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    _, key, value = fused.to(dtype).to(DEVICE).split([num_heads, num_kv_heads, num_kv_heads], 1)
    if layout == "k_view_v_copy":
        return key, value.contiguous()
    if layout == "k_copy_v_view":
        return key.contiguous(), value
    assert layout == "both_views", layout
    return key, value


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Tolerances of expected's dtype; NaN anywhere fails."""
    torch.testing.assert_close(actual, expected, equal_nan=False, **TOLERANCES[expected.dtype])


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def make_batch() -> Callable[..., PagedBatch]:
    return make_paged_batch


@pytest.fixture
def quantize_batch() -> Callable[[PagedBatch, torch.dtype], PagedBatch]:
    return quantize_paged_batch


@pytest.fixture(params=KV_LAYOUTS)
def kv_layout(request: pytest.FixtureRequest) -> str:
    """Each of KV_LAYOUTS in turn."""
    return str(request.param)


@pytest.fixture
def step_kv() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return make_step_kv


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    return _assert_close
