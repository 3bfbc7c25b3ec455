"""The fused experts' packed weights (kernels/cpu/fused_moe.py `pack`): the layout the
kernel reads, and the kernel on sizes that are not whole tiles (K odd, columns past a
panel) and on experts with 0, 1, a register tile's, one more and many rows, against the
torch reference, in float32 and bfloat16 on every ISA build this CPU runs."""

from __future__ import annotations

import pytest
import torch
from isa_builds import MARCHES, skip_unless_runs

from kvflow.kernels.cpu import fused_moe as native
from kvflow.kernels.fused_moe_reference import (
    ClampedSwiGLU,
    Routing,
    combine,
    fused_experts_reference,
    group_by_expert,
)

pytestmark = pytest.mark.native(native._library() is not None)
TOLERANCES = {  # as test_cpu_fused_moe.py's
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}
ROWS_PER_EXPERT = [0, 1, 6, 7, 0, 40, 2, 13]  # 6: the AVX-512 tile's rows, 2: AVX2's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_is_the_documented_one(dtype) -> None:
    experts, hidden, inter = 3, 37, 45  # K odd, I not a multiple of 32, H of 64
    w13 = torch.randn(experts, 2 * inter, hidden).to(dtype)
    w2 = torch.randn(experts, hidden, inter).to(dtype)
    packed = native.pack(w13, w2)
    pair = 2 if dtype == torch.bfloat16 else 1
    assert packed.w13.shape == (experts, 2, (hidden + pair - 1) // pair, 64, pair)
    assert packed.w2.shape == (experts, 1, (inter + pair - 1) // pair, 64, pair)

    def w13_at(e: int, j: int, gate: bool, k: int) -> torch.Tensor:
        column = (j % 32) // 16 * 32 + (0 if gate else 16) + j % 16  # gate, up, gate, up
        return packed.w13[e, j // 32, k // pair, column, k % pair]

    for e, j, k in [(0, 0, 0), (1, 17, 36), (2, 44, 5), (2, 31, 1)]:
        assert w13_at(e, j, True, k) == w13[e, j, k]
        assert w13_at(e, j, False, k) == w13[e, inter + j, k]
    for e, c, i in [(0, 0, 0), (1, 36, 44), (2, 5, 17), (0, 20, 1)]:
        assert packed.w2[e, c // 64, i // pair, c % 64, i % pair] == w2[e, c, i]
    # Padding: intermediate columns 45-63, output columns 37-63 and an odd K's pair.
    assert packed.w13[:, 1, :, 13:16].abs().sum() == 0 and packed.w2[:, :, :, 37:].abs().sum() == 0
    if pair == 2:
        assert packed.w13[:, :, -1, :, 1].abs().sum() == 0


def _uneven_case(dtype: torch.dtype, hidden: int, inter: int, top_k: int, seed: int):
    """Tokens routed so that expert e gets ROWS_PER_EXPERT[e] sorted rows."""
    gen = torch.Generator().manual_seed(seed)
    experts = len(ROWS_PER_EXPERT)
    ids = torch.repeat_interleave(torch.arange(experts), torch.tensor(ROWS_PER_EXPERT))
    ids = ids[torch.randperm(ids.numel(), generator=gen)].reshape(-1, top_k)
    tokens = ids.shape[0]
    x = torch.randn(tokens, hidden + 5, generator=gen).to(dtype)[:, 2 : 2 + hidden]
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    routing = Routing(torch.rand(tokens, top_k, generator=gen), ids)
    return x, w13, w2, routing, group_by_expert(ids, experts)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "inter", "top_k"), [(67, 45, 1), (130, 7, 3), (64, 96, 1)])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_uneven_sizes_and_rows_match_reference(march, dtype, hidden, inter, top_k, gpt_oss) -> None:
    skip_unless_runs(march)
    x, w13, w2, routing, grouping = _uneven_case(dtype, hidden, inter, top_k, seed=hidden)
    assert grouping.offsets.diff().tolist() == ROWS_PER_EXPERT
    options = native.NO_OPTIONS
    if gpt_oss:
        gen = torch.Generator().manual_seed(7)
        experts = len(ROWS_PER_EXPERT)
        b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
        b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
        options = native.ExpertOptions(b13, b2, ClampedSwiGLU(alpha=1.702, limit=1.0))
    expected = fused_experts_reference(
        x, grouping.rows, grouping.offsets, w13, w2, **options._asdict()
    )
    packed = native.pack(w13, w2, march)
    actual = native.fused_experts(x, grouping.rows, grouping.offsets, packed, options)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])
    combined = native.fused_moe(x, grouping, routing, grouping.offsets, packed, options)
    want = combine(expected, grouping, routing)
    torch.testing.assert_close(combined.float(), want.float(), **TOLERANCES[dtype])
