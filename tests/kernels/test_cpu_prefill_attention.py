"""The native CPU prefill attention (causal, and full for vision towers) against its torch
reference."""

from __future__ import annotations

import pytest
import torch
from isa_builds import can_run, skip_unless_runs

from kvflow.kernels.cpu.prefill_attention import (
    full_attention,
    load_prefill_attention,
    prefill_attention_ref,
)

kernel = load_prefill_attention()
pytestmark = pytest.mark.native(kernel is not None)

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


def _kernel_for(march: str):
    skip_unless_runs(march)
    built = load_prefill_attention(march)
    if built is None:
        pytest.skip(f"no -march={march} build here")
    if not built.supports(torch.zeros(1, 1, 64)):
        pytest.skip(f"the -march={march} build has no AVX-512 path (declines, tested below)")
    return built


def _random_qkv(q_len, num_heads, num_kv_heads, head_dim, dtype, seed):
    """Views into one fused QKV projection (token stride > heads * head_dim), as in the
    models."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(q_len, width, generator=gen).to(dtype)
    k0, v0 = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (
        qkv[:, :k0].view(q_len, num_heads, head_dim),
        qkv[:, k0:v0].view(q_len, num_kv_heads, head_dim),
        qkv[:, v0:].view(q_len, num_kv_heads, head_dim),
    )


def _check(kern, q_len, num_heads, num_kv_heads, head_dim, dtype, scale=None, causal=True):
    q, k, v = _random_qkv(q_len, num_heads, num_kv_heads, head_dim, dtype, q_len + head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    # `out` rows are a slice of a larger buffer: rows around it must stay untouched.
    buffer = torch.full((q_len + 2, num_heads, head_dim), 7.0, dtype=dtype)
    kern(q, k, v, buffer[1:-1], scale, causal=causal)
    expected = prefill_attention_ref(q, k, v, scale, causal=causal)
    actual = buffer[1:-1].float()
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])
    assert (buffer[0] == 7.0).all() and (buffer[-1] == 7.0).all()
    return actual, expected


@pytest.mark.parametrize("march", ["native", "x86-64-v4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_path_and_head_group(march, dtype, group):
    """GQA ratios 1..8 (query rows go by 4: groups span positions, and with G = 1..3 a
    short tile has fewer than 4 rows), lengths around the 16-key score vectors, the
    32-query tile and the 64-key block."""
    kern = _kernel_for(march)
    for q_len in (1, 2, 15, 16, 17, 31, 32, 33, 65, 70):
        _check(kern, q_len, 2 * group, 2, 64, dtype)


@pytest.mark.parametrize("march", ["native", "x86-64-v4"])
@pytest.mark.parametrize(("head_dim", "q_len"), [(32, 300), (64, 300), (96, 45), (128, 100)])
def test_every_path_head_dims(march, head_dim, q_len):
    """head_dim 32..128: 96 ends on a 32-column group after a 64-column one."""
    kern = _kernel_for(march)
    for dtype in (torch.float32, torch.bfloat16):
        _check(kern, q_len, 9, 3, head_dim, dtype)


def test_large_scores_are_stable():
    """Scores in the hundreds: the running max is subtracted before exp (no inf/NaN).
    Scores that large carry float32 rounding of ~1e-4 (ulp of 800) into exp, whichever
    order the dot product sums in, hence the looser tolerance."""
    q, k, v = _random_qkv(50, 4, 2, 64, torch.float32, 0)
    actual = torch.empty_like(q)
    kernel(q, k, v, actual, 100.0)
    assert torch.isfinite(actual).all()
    expected = prefill_attention_ref(q, k, v, 100.0)
    torch.testing.assert_close(actual, expected, atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("march", ["native", "x86-64-v4"])
def test_bf16_error_is_that_of_bf16_rounding(march):
    """bfloat16: the weights of V are rounded to bf16 (AVX512_BF16, as FlashAttention
    does), which must cost about as much as the bf16 rounding of the output itself;
    float32 stays far tighter."""
    kern = _kernel_for(march)
    actual, expected = _check(kern, 300, 9, 3, 64, torch.bfloat16)
    rounding_error = (expected.bfloat16().float() - expected).abs().mean()
    assert (actual - expected).abs().mean() < 1.6 * rounding_error
    f32_actual, f32_expected = _check(kern, 300, 9, 3, 64, torch.float32)
    assert (f32_actual - f32_expected).abs().max() < 1e-5


def test_unsupported_shapes_and_builds_decline():
    """head_dim not a multiple of 32, float16, and builds without AVX-512: `supports`
    is False (the backend keeps SDPA), and a direct call raises."""
    assert not kernel.supports(torch.zeros(4, 2, 48))
    q = torch.zeros(4, 2, 64)
    assert kernel.supports(q, q[:, :1], q[:, 1:], q)
    assert not kernel.supports(q, torch.zeros(4, 64, 2).transpose(1, 2))  # strided rows
    assert not kernel.supports(q, q.bfloat16())
    assert not kernel.supports(torch.zeros(4, 2, 64, dtype=torch.float16))
    q = torch.zeros(4, 2, 48)
    with pytest.raises(ValueError, match="unsupported"):
        kernel(q, q, q, torch.empty_like(q), 1.0)
    if can_run("x86-64-v3"):
        portable = load_prefill_attention("x86-64-v3")
        assert portable is not None and not portable.supports(torch.zeros(4, 2, 64))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"key": torch.zeros(5, 2, 64)}, "do not match"),
        ({"out": torch.zeros(4, 4, 64, dtype=torch.bfloat16)}, "dtype"),
        ({"query": torch.zeros(4, 3, 64)}, "bad shapes"),
        ({"value": torch.zeros(4, 64, 2).transpose(1, 2)}, "contiguous"),
    ],
)
def test_rejects_what_would_read_out_of_bounds(change, message):
    args = {
        "query": torch.zeros(4, 4, 64),
        "key": torch.zeros(4, 2, 64),
        "value": torch.zeros(4, 2, 64),
        "out": torch.zeros(4, 4, 64),
    }
    with pytest.raises(ValueError, match=message):
        kernel(**(args | change), scale=1.0)


@pytest.mark.parametrize("march", ["native", "x86-64-v4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "q_len"),
    [(16, 16, 96, 729), (4, 2, 32, 45), (3, 1, 64, 1), (2, 2, 128, 130)],
)
def test_full_attention_sees_every_key(march, dtype, heads, kv_heads, head_dim, q_len):
    """causal=False: every row attends all keys, later ones included (a vision tower)."""
    actual, _ = _check(_kernel_for(march), q_len, heads, kv_heads, head_dim, dtype, causal=False)
    if q_len > 1:  # differs from the causal result: the later keys were read
        causal = prefill_attention_ref(
            *_random_qkv(q_len, heads, kv_heads, head_dim, dtype, q_len + head_dim), head_dim**-0.5
        )
        assert not torch.allclose(actual[0], causal[0], atol=1e-2)


@pytest.mark.parametrize("head_dim", [16, 72, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_towers_full_attention_matches_sdpa(head_dim, dtype):
    """The towers' entry point: [N, H, L, D] of any head size (padded to a multiple of 32
    for the kernel), per image, the same result as torch SDPA."""
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(2, 3, 50, head_dim, generator=gen).to(dtype) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(full_attention(q, k, v).float(), expected, **TOLERANCES[dtype])
