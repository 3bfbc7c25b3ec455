"""Weights the decode step streams live on huge-page-aligned ranges advised MADV_HUGEPAGE."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvflow.kernels.cpu import bf16_gemm, huge_pages

needs_thp = pytest.mark.skipif(
    not huge_pages.thp_available(), reason="this kernel gives no transparent huge pages"
)


def vm_flags(tensor: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping that holds the tensor's first byte (/proc/self/smaps)."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_a_large_tensor_starts_on_a_huge_page_advised_before_first_touch(
    dtype: torch.dtype,
) -> None:
    tensor = huge_pages.empty((3, 1024, 1024), dtype)  # 3-12 MiB: not a whole number of pages
    assert tensor.shape == (3, 1024, 1024) and tensor.dtype == dtype
    assert tensor.is_contiguous() and tensor.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(tensor)  # MADV_HUGEPAGE took: faults map 2 MiB pages
    tensor.fill_(7)
    assert int(tensor.sum().item()) == 7 * tensor.numel()


@needs_thp
def test_the_tensor_keeps_its_mapping_alive() -> None:
    tensor = huge_pages.empty((4 << 20,), torch.uint8)[1 << 20 :]  # only a view survives
    gc.collect()
    tensor.fill_(3)
    assert int(tensor.sum().item()) == 3 * (3 << 20)


def test_a_small_tensor_is_an_ordinary_one() -> None:
    tensor = huge_pages.empty((16, 16), torch.float32)
    assert tensor.shape == (16, 16) and tensor.untyped_storage().nbytes() == 16 * 16 * 4


def test_copy_is_a_contiguous_equal_tensor() -> None:
    source = torch.randn(1024, 1536).t()  # 6 MiB, not contiguous
    copied = huge_pages.copy(source)
    assert copied.is_contiguous() and torch.equal(copied, source)


@needs_thp
@pytest.mark.skipif(not bf16_gemm.available(), reason="no AVX512_BF16 build on this CPU")
def test_packed_bf16_panels_are_on_huge_pages() -> None:
    weight = torch.randn(2048, 1024).to(torch.bfloat16)
    packed = bf16_gemm.pack(weight)
    assert packed is not None and packed.data.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(packed.data)
    x = torch.randn(3, 1024).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), weight.float()).to(torch.bfloat16)
    torch.testing.assert_close(bf16_gemm.bf16_gemm(x, packed), expected, rtol=1e-2, atol=1e-2)
