"""What every kernel launcher shares: device checks, padding and dot operand dtypes.

Kernels run in two modes:
- compiled, on CUDA tensors (the production path);
- interpreted (`TRITON_INTERPRET=1`, read by triton when a kernel is *decorated*), on CPU
  tensors, which is how the test suite checks every kernel on a machine without a GPU.

The interpreter emulates bfloat16 as raw uint16 bits: loads, stores and bf16 -> fp32
casts are right, but arithmetic and `tl.dot` on bf16 values are not, and fp32 -> bf16
casts truncate where the GPU rounds to nearest even. So kernels convert every loaded
value to fp32 before doing arithmetic, `dot_dtype()` picks fp32 dot operands under the
interpreter (bf16/fp16 tensor-core operands when compiled), and values are rounded with
`round_to()` before being stored or cast, which rounds the same way in both modes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_TL_DTYPES: dict[torch.dtype, Any] = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}

FLOAT_DTYPES = tuple(_TL_DTYPES)


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """Interpreted kernels need CPU tensors, compiled ones CUDA tensors; say which clearly."""
    want_cpu = is_interpreted(kernel)
    for t in tensors:
        if want_cpu and t.device.type != "cpu":
            raise ValueError(f"interpreted Triton kernels need CPU tensors, got {t.device}")
        if not want_cpu and t.device.type != "cuda":
            raise ValueError(
                f"Triton kernels need CUDA tensors, got {t.device} "
                "(set TRITON_INTERPRET=1 before importing kvflow.kernels to run them on CPU)"
            )


def dot_dtype(kernel: object, dtype: torch.dtype) -> Any:
    """Operand dtype for `tl.dot` on values stored as `dtype` (see module docstring)."""
    if is_interpreted(kernel) or dtype == torch.float32:
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: Any) -> str:
    """fp32 dots must be exact fp32 ("ieee"), not TF32, to meet fp32 tolerances."""
    return "ieee" if dtype == tl.float32 else "tf32"


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to the nearest `dtype` value (ties to even), still as fp32.

    For bf16 this is done on the bits (add half an ulp of bf16, then drop the low 16
    bits) so that the interpreter rounds like the GPU; NaN and inf stay as they are."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def kernels_interpreted() -> bool:
    """True when kvflow's kernels were decorated under TRITON_INTERPRET=1 (all or none are:
    they are decorated when their modules are imported, which import this one first)."""
    return is_interpreted(round_to)


def next_pow2(n: int) -> int:
    """Triton block shapes are powers of two; pad real sizes up and mask the tail."""
    return int(triton.next_power_of_2(max(int(n), 1)))


def assert_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}"


@lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; other devices (the interpreter's CPU) report 1."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
