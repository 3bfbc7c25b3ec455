"""The fused experts' gpt-oss options (expert biases, the clamped SwiGLU, top-k-then-
softmax routing): the torch reference against transformers' GptOss experts (whose
checkpoint layout interleaves gate and up columns), then the native CPU kernel (float32
and bfloat16, on every ISA build this CPU runs) and the Triton kernel (interpreted on
CPU) against the reference."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from conftest import TOLERANCES as TRITON_TOLERANCES
from isa_builds import MARCHES, skip_unless_runs

from kvflow.kernels.cpu import fused_moe as native
from kvflow.kernels.fused_moe_reference import (
    ClampedSwiGLU,
    combine,
    fused_experts_reference,
    group_by_expert,
    route_topk_softmax,
)
from kvflow.kernels.fused_moe_triton import fused_experts as triton_fused_experts

CLAMPED = ClampedSwiGLU(alpha=1.702, limit=1.5)  # a low limit, so that clamps bite
# As tests/kernels/test_cpu_fused_moe.py's: sums in another order, bf16 ulp flips.
NATIVE_TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


def _case(tokens, hidden, inter, experts, top_k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden + 6, generator=gen).to(dtype)[:, 3 : 3 + hidden]
    w13 = (2 * torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
    routing = route_topk_softmax(torch.randn(tokens, experts, generator=gen), top_k)
    return x, (w13, w2, b13, b2), routing, group_by_expert(routing.ids, experts)


def test_routing_is_a_softmax_over_the_top_k_logits() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    routing = route_topk_softmax(logits, 2)
    assert routing.ids.tolist() == [[1, 3]]
    torch.testing.assert_close(routing.weights, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))


def test_reference_matches_transformers_gpt_oss_experts() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hidden, inter, experts, top_k = 16, 12, 4, 2
    config = GptOssConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
        num_experts_per_tok=top_k, swiglu_limit=CLAMPED.limit,
    )  # fmt: skip
    # Standalone experts have no dispatch set; some transformers versions then pick a
    # batched kernel rather than the module's own (eager) forward, which is the spec here.
    config._experts_implementation = "eager"
    hf = GptOssExperts(config)
    x, (w13, w2, b13, b2), routing, grouping = _case(
        9, hidden, inter, experts, top_k, torch.float32, 1
    )
    x = x.contiguous()
    # The checkpoint's layout: gate_up_proj [E, H, 2I] with gate, up in alternate columns.
    interleaved = torch.stack((w13[:, :inter], w13[:, inter:]), dim=2).reshape(experts, -1, hidden)
    bias = torch.stack((b13[:, :inter], b13[:, inter:]), dim=2).reshape(experts, -1)
    with torch.no_grad():
        hf.gate_up_proj.copy_(interleaved.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(bias)
        hf.down_proj.copy_(w2.transpose(1, 2))
        hf.down_proj_bias.copy_(b2)
        expected = hf(x, routing.ids, routing.weights)
    y = fused_experts_reference(
        x, grouping.rows, grouping.offsets, w13, w2, b13=b13, b2=b2, clamped=CLAMPED
    )
    torch.testing.assert_close(combine(y, grouping, routing), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.native(native._library() is not None)
@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamped", [CLAMPED, None])
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [(1, 64, 32, 8, 2), (23, 40, 19, 6, 3), (29, 67, 45, 3, 2)],  # + odd K, a part panel
)
def test_native_kernel_matches_reference(
    march, dtype, clamped, tokens, hidden, inter, experts, top_k
) -> None:
    skip_unless_runs(march)
    x, (w13, w2, b13, b2), routing, grouping = _case(
        tokens, hidden, inter, experts, top_k, dtype, seed=tokens
    )
    options = native.ExpertOptions(b13, b2, clamped)
    expected = fused_experts_reference(
        x, grouping.rows, grouping.offsets, w13, w2, b13=b13, b2=b2, clamped=clamped
    )
    packed = native.pack(w13, w2, march)
    actual = native.fused_experts(x, grouping.rows, grouping.offsets, packed, options)
    torch.testing.assert_close(actual.float(), expected.float(), **NATIVE_TOLERANCES[dtype])
    combined = native.fused_moe(x, grouping, routing, grouping.offsets, packed, options)
    torch.testing.assert_close(
        combined.float(),
        combine(expected, grouping, routing).float(),
        **NATIVE_TOLERANCES[dtype],
    )


@pytest.mark.native(native._library() is not None)
def test_native_kernel_refuses_a_bias_that_does_not_fit() -> None:
    x, (w13, w2, b13, b2), _, grouping = _case(3, 32, 16, 4, 2, torch.float32, 5)
    with pytest.raises(ValueError, match="b2"):
        native.fused_experts(
            x, grouping.rows, grouping.offsets, native.pack(w13, w2),
            options=native.ExpertOptions(b13, b2[:, :8]),
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamped", [CLAMPED, None])
def test_triton_kernel_matches_reference(dtype, clamped) -> None:
    x, (w13, w2, b13, b2), _, grouping = _case(11, 40, 70, 6, 2, dtype, seed=3)
    expected = fused_experts_reference(
        x, grouping.rows, grouping.offsets, w13, w2, b13=b13, b2=b2, clamped=clamped
    )
    args = [t.to(DEVICE) for t in (x, grouping.rows, grouping.offsets, w13, w2)]
    actual = triton_fused_experts(*args, b13=b13.to(DEVICE), b2=b2.to(DEVICE), clamped=clamped)
    torch.testing.assert_close(actual.cpu().float(), expected.float(), **TRITON_TOLERANCES[dtype])
    plain = fused_experts_reference(x, grouping.rows, grouping.offsets, w13, w2)
    assert (expected.float() - plain.float()).abs().max() > 0.1  # the options matter
