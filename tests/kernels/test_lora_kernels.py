"""The grouped LoRA product: the native CPU kernel and the Triton kernel (interpreted)
against the torch reference, on mixed rows (base rows, several slots, unsorted),
packed slices of unequal sizes, ranks padded with zeros, float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from isa_builds import MARCHES, skip_unless_runs

from kvflow.kernels.cpu import lora as lora_native
from kvflow.kernels.lora import group_rows, lora_add_reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CASES = [  # (rows' slots, K, slice sizes, rank)
    ([0, -1, 1, 0, 2, -1, 1], 40, [24, 8, 8], 8),  # q|k|v, unsorted rows, base rows
    ([1, 1, 1, 1], 19, [13], 4),  # one adapter, consecutive rows (a view), odd sizes
    ([-1, -1], 16, [16, 16], 2),  # the base alone: nothing changes
    # Slot 0: a block of 8 rows (two 4-row shrink tiles) and one of 2; K past two bf16
    # passes of 32, a 16-wide pass and a scalar tail; S*R = 6, not a multiple of 4.
    ([0, 1, 0, 1, 0, 1, 0, 1, 0, -1, 0, 2, 0, 0, 0, 0], 83, [20, 37], 3),
]


def _case(slots: list[int], k: int, sizes: list[int], rank: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    n, num_slices = sum(sizes), len(sizes)
    x = torch.randn(len(slots), k).to(dtype)
    y = torch.randn(len(slots), n).to(dtype)
    a = torch.randn(3, num_slices * rank, k).to(dtype)
    b = torch.randn(3, rank, n).to(dtype)
    b[:, rank // 2 :] = 0  # a lower-rank adapter, zero-padded
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    slices = list(zip(offsets, sizes))
    return x, y, a, b, slices, group_rows(np.array(slots), torch.device("cpu"))


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.float().abs().max().clamp(min=1.0)
    assert ((got.float() - want.float()).abs().max() / scale) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_a_per_row_loop(case: tuple, dtype: torch.dtype) -> None:  # type: ignore[type-arg]
    x, y, a, b, slices, groups = _case(*case, dtype)
    want = y.float().clone()
    rank = b.shape[1]
    for row, slot in enumerate(case[0]):
        if slot < 0:
            continue
        shrunk = a[slot].float() @ x[row].float()
        for i, (off, size) in enumerate(slices):
            want[row, off : off + size] += (
                shrunk[i * rank : (i + 1) * rank] @ b[slot, :, off : off + size].float()
            )
    got = y.clone()
    lora_add_reference(x, got, a, b, slices, groups)
    _check(got, want, dtype)


@pytest.mark.native(lora_native._library() is not None)
@pytest.mark.parametrize("march", MARCHES)  # AVX-512 (16-wide) and the AVX2 fallback
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_native_cpu_kernel_matches_reference(case: tuple, dtype: torch.dtype, march: str) -> None:  # type: ignore[type-arg]
    skip_unless_runs(march)
    x, y, a, b, slices, groups = _case(*case, dtype)
    want, got = y.clone(), y.clone()
    lora_add_reference(x, want, a, b, slices, groups)
    assert lora_native.native_applies(x, got, a, b)
    lora_native.lora_add_native(x, got, a, b, slices, groups.row_slots, march=march)
    _check(got, want, dtype)
    if all(s < 0 for s in case[0]):
        assert torch.equal(got, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_reference(
    case: tuple,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
) -> None:
    from kvflow.kernels.launch_utils import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("runs under TRITON_INTERPRET=1 (tests/kernels sets it) or on CUDA")
    from kvflow.kernels.lora_triton import lora_add_triton

    x, y, a, b, slices, groups = _case(*case, dtype)
    want, got = y.clone(), y.clone()
    lora_add_reference(x, want, a, b, slices, groups)
    lora_add_triton(x, got, a, b, slices, groups.row_slots)
    _check(got, want, dtype)
