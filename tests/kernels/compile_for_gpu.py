"""Compile each kernel, through its real launcher, for a CUDA target without a GPU.

Usage: python compile_for_gpu.py [ARCH]   (ARCH like 90 for H100; default 90)

The interpreter checks what a kernel computes, not whether triton can compile it (it
accepts ops and types the compiler rejects). This script closes that gap on machines
without a GPU: every launcher runs on CPU tensors with its kernel replaced by a recorder
that turns the launch's arguments into a signature and compiles it for the target with
triton's bundled ptxas. Run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget

from kvflow.kernels import (
    activation,
    fused_moe_triton,
    grammar_bitmask,
    kv_codec,
    paged_attention,
    rms_norm,
    rotary,
    store_kv,
)

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}  # fmt: skip


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if abs(value) < 2**31 else "i64"
    assert isinstance(value, float), value
    return "fp32"


class _CompileOnLaunch:
    """Stands in for `kernel[grid](...)`: compiles instead of launching."""

    def __init__(self, kernel: Any, target: GPUTarget, done: list[str]) -> None:
        self.kernel, self.target, self.done = kernel, target, done

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def compile_launch(*args: Any, **constexprs: Any) -> None:
            signature = {n: _arg_type(v) for n, v in zip(self.kernel.arg_names, args)}
            signature.update(dict.fromkeys(constexprs, "constexpr"))
            source = triton.compiler.ASTSource(self.kernel, signature, constexprs)
            triton.compile(source, target=self.target)
            self.done.append(f"{self.kernel.__name__} {constexprs}")

        return compile_launch


def _patch(target: GPUTarget, done: list[str]) -> None:
    kernels = [(store_kv, "_store_kv_kernel"), (rms_norm, "_rms_norm_kernel"),
               (rotary, "_rotary_kernel"), (activation, "_silu_and_mul_kernel"),
               (grammar_bitmask, "_apply_bitmask_kernel"),
               (paged_attention, "_paged_attention_kernel"),
               (paged_attention, "_split_kv_merge_kernel"),
               (fused_moe_triton, "_grouped_gemm_kernel")]  # fmt: skip
    for module, name in kernels:
        setattr(module, name, _CompileOnLaunch(getattr(module, name), target, done))
        module.check_device = lambda *args: None  # CPU tensors stand in for CUDA ones
    paged_attention.is_interpreted = lambda kernel: False


def _launch_all() -> None:
    """Representative launches: bf16, Llama-8B-like heads, decode and prefill tiles."""
    bf16, i32, i64 = torch.bfloat16, torch.int32, torch.int64
    q, k = torch.zeros(8, 32, 128, dtype=bf16), torch.zeros(8, 8, 128, dtype=bf16)
    cache = torch.zeros(2, 10, 16, 8, 128, dtype=bf16)
    store_kv.store_kv(k, k, cache, torch.zeros(8, dtype=i64))
    x, w = torch.zeros(8, 4096, dtype=bf16), torch.zeros(4096, dtype=bf16)
    rms_norm.fused_add_rms_norm(x, x, w, 1e-6)
    rotary.rotary_embedding(torch.zeros(8, dtype=i64), q, k, torch.zeros(16, 128))
    activation.silu_and_mul(torch.zeros(8, 2048, dtype=bf16))
    logits, mask = torch.zeros(2, 1000), torch.zeros(2, 32, dtype=i32)
    grammar_bitmask.apply_grammar_bitmask(logits, mask, torch.zeros(2, dtype=i64))
    step = (q, cache, torch.zeros(3, dtype=i32), torch.zeros(2, dtype=i32),
            torch.zeros(2, 5, dtype=i32), 0.1)  # fmt: skip
    paged_attention.unified_paged_attention(*step, max_query_len=512)
    paged_attention.split_kv_paged_attention(*step, 64, max_query_len=1, num_splits=8)
    sinks = torch.zeros(32, dtype=bf16)  # gpt-oss: a sink per query head
    paged_attention.unified_paged_attention(*step, max_query_len=512, sinks=sinks)
    paged_attention.split_kv_paged_attention(*step, max_query_len=1, num_splits=8, sinks=sinks)
    _launch_quantized(q, k)
    _launch_fused_experts()


def _launch_fused_experts() -> None:
    """The grouped GEMMs plain (Qwen, Mixtral) and with gpt-oss's biases and clamped SwiGLU."""
    bf16, i64 = torch.bfloat16, torch.int64
    x, rows, offsets = (
        torch.zeros(8, 256, dtype=bf16),
        torch.zeros(16, dtype=i64),
        torch.zeros(5, dtype=i64),
    )
    w13, w2 = torch.zeros(4, 128, 256, dtype=bf16), torch.zeros(4, 256, 64, dtype=bf16)
    fused_moe_triton.fused_experts(x, rows, offsets, w13, w2)
    b13, b2 = torch.zeros(4, 128, dtype=bf16), torch.zeros(4, 256, dtype=bf16)
    clamped = fused_moe_triton.ClampedSwiGLU(1.702, 7.0)
    fused_moe_triton.fused_experts(x, rows, offsets, w13, w2, b13=b13, b2=b2, clamped=clamped)


def _launch_quantized(q: torch.Tensor, k: torch.Tensor) -> None:
    """A quantized cache per codec: the store quantizes, attention reads codes (and fresh
    rows for prefills without a cached prefix)."""
    i32, i64 = torch.int32, torch.int64
    for dtype in kv_codec.CODEC_DTYPES.values():
        cache = torch.zeros(2, 10, 16, 8, 128 + kv_codec.SCALE_BYTES, dtype=dtype)
        store_kv.store_kv(k, k, cache, torch.zeros(8, dtype=i64))
        step = (q, cache, torch.zeros(3, dtype=i32), torch.zeros(2, dtype=i32),
                torch.zeros(2, 5, dtype=i32), 0.1)  # fmt: skip
        paged_attention.unified_paged_attention(*step, max_query_len=512, fresh_kv=(k, k))
    paged_attention.split_kv_paged_attention(*step, max_query_len=1, num_splits=8)
    q16 = q.to(torch.float16)  # fp16 dot operands dequantize V (see paged_attention_kernels)
    paged_attention.unified_paged_attention(q16, *step[1:], max_query_len=1)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET"
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    done: list[str] = []
    _patch(GPUTarget("cuda", arch, 32), done)
    _launch_all()
    print("\n".join(done))
    print(f"compiled {len(done)} kernels for sm_{arch}")


if __name__ == "__main__":
    main()
