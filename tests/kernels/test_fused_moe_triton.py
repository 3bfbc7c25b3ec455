"""The Triton fused experts (grouped GEMMs) against the torch reference; interpreted on CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, TOLERANCES

from kvflow.kernels.fused_moe_reference import fused_experts_reference, group_by_expert, route
from kvflow.kernels.fused_moe_triton import BLOCK_M, _block_plan, fused_experts


def _case(tokens, hidden, inter, experts, top_k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden + 6, generator=gen).to(dtype)[:, 3 : 3 + hidden]
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    routing = route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=False)
    return x, w13, w2, group_by_expert(routing.ids, experts)


def test_block_plan_follows_the_documented_example() -> None:
    expert, row = _block_plan(torch.tensor([0, 5, 5, 21]), 21)
    used = expert < 3
    assert expert[used].tolist() == [0, 2] and row[used].tolist() == [0, 5]
    assert expert.shape[0] == 2 + 3 and BLOCK_M == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [(1, 32, 16, 8, 2), (21, 72, 40, 4, 3), (6, 19, 70, 12, 2)],  # ragged, K and N tails
)
def test_matches_reference(dtype, tokens, hidden, inter, experts, top_k) -> None:
    x, w13, w2, grouping = _case(tokens, hidden, inter, experts, top_k, dtype, seed=tokens)
    assert (grouping.offsets.diff() == 0).any() or tokens >= experts  # empty experts too
    expected = fused_experts_reference(x, grouping.rows, grouping.offsets, w13, w2)
    args = [t.to(DEVICE) for t in (x, grouping.rows, grouping.offsets, w13, w2)]
    actual = fused_experts(*args)
    assert actual.dtype == dtype and actual.shape == (tokens * top_k, hidden)
    torch.testing.assert_close(actual.cpu().float(), expected.float(), **TOLERANCES[dtype])


def test_a_slice_of_the_experts_leaves_the_other_rows_zero() -> None:
    x, w13, w2, grouping = _case(9, 32, 16, 6, 2, torch.float32, seed=7)
    local = grouping.offsets[2:5]  # experts 2, 3 of 6 (expert parallel)
    expected = fused_experts_reference(x, grouping.rows, local, w13[2:4], w2[2:4])
    args = (x, grouping.rows, local, w13[2:4].contiguous(), w2[2:4].contiguous())
    actual = fused_experts(*[t.to(DEVICE) for t in args]).cpu()
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float32])
    assert actual[: int(local[0])].abs().sum() == 0 and actual[int(local[-1]) :].abs().sum() == 0
