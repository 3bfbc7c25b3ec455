"""The native fused experts against their torch reference, on every ISA build this CPU runs."""

from __future__ import annotations

import pytest
import torch
from isa_builds import MARCHES, skip_unless_runs

from kvflow.kernels.cpu import fused_moe as module
from kvflow.kernels.cpu.fused_moe import fused_experts, fused_moe, pack
from kvflow.kernels.fused_moe_reference import (
    Routing,
    combine,
    fused_experts_reference,
    group_by_expert,
    route,
)

pytestmark = pytest.mark.native(module._library() is not None)
# Sums in another order; bf16 rounds the gate/up products, silu, act and y like the
# reference, so a flip of one bf16 ulp in an intermediate is what separates them.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


def _operands(tokens: int, hidden: int, inter: int, experts: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, hidden + 8, generator=gen)  # x with a row stride > hidden
    x = wide.to(dtype)[:, 4 : 4 + hidden]
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return x, w13, w2


def test_grouping_matches_the_documented_example() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    grouping = group_by_expert(ids, 4)
    assert grouping.rows.tolist() == [0, 2, 0, 1, 2, 1]
    assert grouping.offsets.tolist() == [0, 2, 2, 5, 6]
    assert ids.reshape(-1)[grouping.order].tolist() == [0, 0, 2, 2, 2, 3]
    assert grouping.order[grouping.inverse].tolist() == list(range(6))


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [(1, 64, 32, 8, 2), (37, 72, 40, 6, 3), (5, 19, 7, 16, 4)],  # ragged, tails, empties
)
def test_matches_reference(march, dtype, tokens, hidden, inter, experts, top_k) -> None:
    skip_unless_runs(march)
    x, w13, w2 = _operands(tokens, hidden, inter, experts, dtype, seed=tokens * hidden)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(1))
    routing = route(logits, top_k, renormalize=True)
    grouping = group_by_expert(routing.ids, experts)
    counts = grouping.offsets.diff()
    assert (counts == 0).any() or tokens > experts  # some experts get no token
    expected = fused_experts_reference(x, grouping.rows, grouping.offsets, w13, w2)
    packed = pack(w13, w2, march)
    actual = fused_experts(x, grouping.rows, grouping.offsets, packed)
    assert actual.dtype == dtype and actual.shape == (tokens * top_k, hidden)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])
    combined = fused_moe(x, grouping, routing, grouping.offsets, packed)
    assert combined.dtype == dtype and combined.shape == (tokens, hidden)
    torch.testing.assert_close(
        combined.float(), combine(expected, grouping, routing).float(), **TOLERANCES[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slice_of_the_experts_writes_only_their_rows(dtype) -> None:
    """Expert parallelism: a rank passes its experts' offsets (absolute rows); the other
    experts' rows stay zero, as in the reference."""
    x, w13, w2 = _operands(9, 32, 16, 6, dtype, seed=3)
    ids = torch.randint(0, 6, (9, 2), generator=torch.Generator().manual_seed(4))
    grouping = group_by_expert(ids, 6)
    local = grouping.offsets[2:5]  # experts 2, 3 (of 6)
    expected = fused_experts_reference(x, grouping.rows, local, w13[2:4], w2[2:4])
    packed = pack(w13[2:4], w2[2:4])
    actual = fused_experts(x, grouping.rows, local, packed)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])
    start, end = local[0].item(), local[-1].item()
    assert actual[:start].abs().sum() == 0 and actual[end:].abs().sum() == 0
    assert actual[start:end].abs().sum() > 0
    routing = Routing(torch.rand(9, 2, generator=torch.Generator().manual_seed(5)), ids)
    combined = fused_moe(x, grouping, routing, local, packed)
    want = combine(expected, grouping, routing)  # other experts' slots add nothing
    torch.testing.assert_close(combined.float(), want.float(), **TOLERANCES[dtype])
    chose_none = ~((ids == 2) | (ids == 3)).any(dim=1)
    assert chose_none.any() and combined[chose_none].abs().sum() == 0


def test_refuses_mismatched_operands() -> None:
    x, w13, w2 = _operands(3, 32, 16, 4, torch.float32, seed=5)
    grouping = group_by_expert(torch.zeros(3, 1, dtype=torch.int64), 4)
    with pytest.raises(ValueError):
        pack(w13, w2.transpose(1, 2).contiguous())
    with pytest.raises(ValueError):
        pack(w13, w2.to(torch.bfloat16))
    packed = pack(w13, w2)
    with pytest.raises(ValueError):
        fused_experts(x.to(torch.bfloat16), grouping.rows, grouping.offsets, packed)
    with pytest.raises(ValueError):
        fused_experts(x[:, :16], grouping.rows, grouping.offsets, packed)
    with pytest.raises(ValueError):
        fused_experts(x, grouping.rows, grouping.offsets[:3], packed)
