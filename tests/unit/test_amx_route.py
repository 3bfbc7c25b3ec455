"""packed_linear.amx_bf16: oneDNN runs bf16 on AMX where the CPU has it and
ONEDNN_MAX_CPU_ISA, where set, admits it (the packing route follows it)."""

from __future__ import annotations

import pytest

from kvflow.kernels.cpu import packed_linear


@pytest.mark.parametrize(
    ("flags", "cap", "expected"),
    [
        ({"avx512_bf16"}, None, False),
        ({"avx512_bf16", "amx_bf16"}, None, True),
        ({"avx512_bf16", "amx_bf16"}, "avx512_core_amx", True),
        ({"avx512_bf16", "amx_bf16"}, "AVX512_CORE_BF16", False),
        ({"avx512_bf16", "amx_bf16"}, "all", True),
    ],
)
def test_amx_follows_the_flags_and_the_isa_cap(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], cap: str | None, expected: bool
) -> None:
    monkeypatch.setattr(packed_linear, "available", lambda dtype: True)  # any machine's oneDNN
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: flags)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    packed_linear.amx_bf16.cache_clear()
    try:
        assert packed_linear.amx_bf16() is expected
    finally:
        packed_linear.amx_bf16.cache_clear()
