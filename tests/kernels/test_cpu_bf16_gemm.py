"""The native bf16 GEMM against F.linear with float32 accumulation, its packed layout,
and where it steps aside (CPUs without AVX512_BF16 keep oneDNN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from isa_builds import skip_unless_runs

from kvflow.kernels.cpu import bf16_gemm
from kvflow.kernels.cpu.bf16_gemm import PanelWeight
from kvflow.kernels.cpu.bf16_gemm import bf16_gemm as gemm

pytestmark = pytest.mark.native(bf16_gemm._library() is not None)
needs_dpbf16 = pytest.mark.skipif(
    not bf16_gemm.available(), reason="this CPU has no AVX512_BF16: oneDNN serves bf16"
)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float32 (exact products of bf16 values), rounded once to bf16."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).bfloat16()


def _assert_within_rounding(
    actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Only the float32 summation order differs from the reference, so the bf16 outputs
    differ by at most one bf16 step (2^-7 relative, where a sum lies near a rounding
    boundary) plus float32's summation error (relative to the sum of |products|, which
    matters where terms cancel); almost all are equal."""
    expected = _reference(x, weight, bias)
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    diff = (actual.float() - expected.float()).abs()
    magnitude = F.linear(x.float().abs(), weight.float().abs())
    bound = expected.float().abs() * 2.0**-7 + magnitude * 2.0**-18
    assert bool((diff <= bound).all()), f"max |diff| {diff.max().item()}"
    assert (actual != expected).float().mean().item() < 0.02


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 17, 64, 67, 130])
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"),
    [
        (576, 960, False),  # SmolLM2's q|k|v (whole panels)
        (64, 100, True),  # N not a multiple of the panel: masked stores, padded panel
        (50, 37, False),  # K not a multiple of 32 (even), N < one vector
        (2, 16, True),  # one k-pair
    ],
)
def test_matches_f_linear(rows, in_features, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    wide = torch.randn(rows, in_features + 12, generator=gen).bfloat16()
    x = wide[:, 6 : 6 + in_features]  # a view with row stride > in_features
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    packed = bf16_gemm.pack(weight)
    assert packed is not None and bf16_gemm.applies(x, packed, b)
    _assert_within_rounding(gemm(x, packed, b), x, weight, b)


@needs_dpbf16
@pytest.mark.parametrize(("rows", "in_features"), [(600, 1536), (257, 576), (2049, 576)])
def test_long_prefill_goes_by_row_blocks(rows, in_features):
    """More rows than one L2 block of x (256 KB): row blocks of whole tiles, as even as
    they can be (the last one short by up to a tile), split between threads."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(200, in_features, generator=gen).bfloat16()
    packed = bf16_gemm.pack(weight)
    assert packed is not None
    _assert_within_rounding(gemm(x, packed), x, weight, None)


@needs_dpbf16
def test_packed_layout_holds_k_pairs_of_panel_columns():
    panel = bf16_gemm.panel_width()
    weight = torch.arange(70 * 6, dtype=torch.float32).view(70, 6).bfloat16()
    packed = bf16_gemm.pack(weight)
    assert packed is not None
    assert packed.data.shape == (2, 3, panel, 2)  # 70 columns -> 2 panels, 6 k -> 3 pairs
    assert torch.equal(packed.data[1, 2, 3], weight[panel + 3, 4:6])
    assert bool((packed.data[1, :, 70 - panel :] == 0).all())  # padding columns


@needs_dpbf16
def test_zero_rows_and_mismatched_input():
    packed = bf16_gemm.pack(torch.randn(32, 64).bfloat16())
    assert packed is not None
    assert gemm(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)
    with pytest.raises(ValueError, match="does not fit"):
        gemm(torch.randn(4, 64), packed)  # float32 input
    with pytest.raises(ValueError, match="does not fit"):
        gemm(torch.randn(4, 62).bfloat16(), packed)
    with pytest.raises(ValueError, match="does not fit"):
        gemm(torch.randn(64, 4).bfloat16().t(), packed)  # columns not contiguous


def test_only_even_width_cpu_bf16_weights_are_packed():
    assert bf16_gemm.pack(torch.zeros(4, 4)) is None
    assert bf16_gemm.pack(torch.zeros(4, 5, dtype=torch.bfloat16)) is None
    assert bf16_gemm.pack(torch.zeros(4, dtype=torch.bfloat16)) is None


def test_build_without_avx512_bf16_refuses():
    """An AVX-512 build without the bf16 instructions reports no kernel, so pack() leaves
    such CPUs to oneDNN; a call that reaches it anyway fails loudly, never silently."""
    skip_unless_runs("x86-64-v4")
    assert not bf16_gemm.available("x86-64-v4")
    assert bf16_gemm.pack(torch.zeros(16, 16, dtype=torch.bfloat16), "x86-64-v4") is None
    forced = PanelWeight(torch.zeros(1, 8, 48, 2, dtype=torch.bfloat16), 16, 16, "x86-64-v4")
    with pytest.raises(RuntimeError, match="status 3"):
        gemm(torch.zeros(2, 16, dtype=torch.bfloat16), forced)


# ---- silu(gate) * up fused into the GEMM of a gate|up layer --------------------------


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 64, 600])
@pytest.mark.parametrize(
    ("in_features", "inter", "bias"),
    [
        (576, 1536, False),  # SmolLM2's MLP (whole panels)
        (64, 100, True),  # each half padded: the up's panels start past the padding
        (40, 20, True),  # inter < one panel, one vector and a masked one
    ],
)
def test_fused_silu_and_mul_is_the_unfused_pair_bit_for_bit(rows, in_features, inter, bias):
    from kvflow.kernels.cpu import elementwise

    gen = torch.Generator().manual_seed(rows * 7 + inter)
    wide = torch.randn(rows, in_features + 4, generator=gen).bfloat16()
    x = wide[:, 2 : 2 + in_features]
    weight = (torch.randn(2 * inter, in_features, generator=gen) * 0.2).bfloat16()
    b = torch.randn(2 * inter, generator=gen).bfloat16() if bias else None
    plain, glu = bf16_gemm.pack(weight), bf16_gemm.pack(weight, glu=True)
    assert plain is not None and glu is not None and glu.glu
    unfused = elementwise.silu_and_mul(gemm(x, plain, b))
    assert torch.equal(bf16_gemm.bf16_gemm_silu_and_mul(x, glu, b), unfused)
    # The halves' layout still serves a plain call (each half, side by side).
    assert torch.equal(gemm(x, glu, b), gemm(x, plain, b))


@needs_dpbf16
def test_glu_packing_pads_each_half_to_whole_panels():
    panel = bf16_gemm.panel_width()
    weight = torch.randn(2 * 50, 8).bfloat16()
    glu = bf16_gemm.pack(weight, glu=True)
    assert glu is not None and glu.data.shape == (4, 4, panel, 2)  # 50 -> 2 panels a half
    assert torch.equal(glu.data[2, 1, 0], weight[50, 2:4])  # up's first column, k 2-3
    assert bool((glu.data[1, :, 50 - panel :] == 0).all())  # the gate's padding
    assert bf16_gemm.pack(torch.zeros(5, 8, dtype=torch.bfloat16), glu=True) is None
    with pytest.raises(ValueError, match="glu=True"):
        bf16_gemm.bf16_gemm_silu_and_mul(torch.zeros(2, 8).bfloat16(), bf16_gemm.pack(weight))


def test_a_glu_layer_needs_two_equal_halves():
    from kvflow.gpu_worker.layers.linear import MergedColumnParallelLinear

    assert MergedColumnParallelLinear(8, [6, 6], bias=False, glu=True).glu
    with pytest.raises(ValueError, match="two equal halves"):
        MergedColumnParallelLinear(8, [6, 4], bias=False, glu=True)
