"""The -march builds a native kernel's tests run, and which of them this CPU can execute.

native      whatever this CPU has (AVX512_BF16 dot products where present)
x86-64-v4   AVX-512 without the bf16 instructions
x86-64-v3   AVX2 + FMA: the CPUs without AVX-512
"""

from __future__ import annotations

import pytest

from kvflow.kernels.cpu.native_build import cpu_flags

MARCH_NEEDS = {
    "native": set(),
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": {"avx2", "fma", "bmi2", "movbe"},
}
MARCHES = list(MARCH_NEEDS)


def can_run(march: str) -> bool:
    flags = cpu_flags()
    return MARCH_NEEDS[march] <= flags and (march == "native" or bool(flags))


def skip_unless_runs(march: str) -> None:
    """An older -march is built and run only where this CPU can execute its code."""
    if not can_run(march):
        pytest.skip(f"this CPU cannot run -march={march} code")
