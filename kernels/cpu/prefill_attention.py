"""Launcher of the native causal prefill attention (prefill_attention.cpp).

For a prompt with no cached prefix and no sliding window: query row i attends the
step's own key/value rows 0 .. i. The torch reference is `prefill_attention_ref` (what
gpu_worker/attention/torch_backend.py runs for every other prefill). `full_attention`
runs a vision tower's bidirectional attention on the same kernel.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kvflow.kernels.cpu import native_calls
from kvflow.kernels.cpu.native_build import DTYPE_CODES, INT64, POINTER, load_bound

_SIGNATURES: dict[str, list[type]] = {
    "kvflow_prefill_attention": [
        ctypes.c_int,
        *[POINTER] * 4,
        *[INT64] * 8,
        ctypes.c_float,
        ctypes.c_int,
    ],
    "kvflow_prefill_attention_supports": [INT64],
}


class PrefillAttention:
    """The compiled kernel behind a shape-checking call; see `load_prefill_attention`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.kvflow_prefill_attention
        self._supports = library.kvflow_prefill_attention_supports

    def runs_head_dim(self, head_dim: int) -> bool:
        """Whether this build has a path for `head_dim` (AVX-512, a multiple of 32)."""
        return bool(self._supports(head_dim))

    def supports(self, query: torch.Tensor, *others: torch.Tensor) -> bool:
        """Whether this build runs `query`'s device, dtype and head_dim (AVX-512 builds,
        head_dim a multiple of 32), and `others` (key, value, out) have its dtype and
        contiguous [heads, head_dim] rows; the caller keeps torch SDPA otherwise."""
        head_dim = query.shape[-1]
        return (
            query.device.type == "cpu"
            and query.dtype in DTYPE_CODES
            and self.runs_head_dim(head_dim)
            and all(
                t.dtype == query.dtype
                and t.device == query.device
                and t.stride()[1:] == (head_dim, 1)
                for t in (query, *others)
            )
        )

    def __call__(
        self,
        query: torch.Tensor,  # [q_len, num_heads, head_dim]
        key: torch.Tensor,  # [q_len, num_kv_heads, head_dim]
        value: torch.Tensor,  # [q_len, num_kv_heads, head_dim]
        out: torch.Tensor,  # [q_len, num_heads, head_dim], written
        scale: float,
        causal: bool = True,  # False: every row attends every key (a vision tower)
    ) -> None:
        q_len, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        dtype = query.dtype
        if query.device.type != "cpu" or dtype not in DTYPE_CODES or not self._supports(head_dim):
            raise ValueError(f"unsupported here: {dtype} on {query.device}, head_dim {head_dim}")
        for name, t in (("key", key), ("value", value), ("out", out)):
            if t.dtype != dtype or t.device != query.device:
                raise ValueError(f"{name} must share the query's dtype and device")
        if key.shape != (q_len, num_kv_heads, head_dim) or value.shape != key.shape:
            raise ValueError(f"key/value {tuple(key.shape)} do not match query {query.shape}")
        if out.shape != query.shape or q_len < 1 or num_heads % num_kv_heads:
            raise ValueError(f"bad shapes: query {query.shape}, out {out.shape}, key {key.shape}")
        for name, t in (("query", query), ("key", key), ("value", value), ("out", out)):
            if t.stride()[1:] != (head_dim, 1):
                raise ValueError(f"{name} must have contiguous [heads, head_dim] rows")
        status = native_calls.run(
            self._fn,
            DTYPE_CODES[dtype],
            query.data_ptr(),
            key.data_ptr(),
            value.data_ptr(),
            out.data_ptr(),
            q_len,
            num_heads,
            num_kv_heads,
            head_dim,
            query.stride(0),
            key.stride(0),
            value.stride(0),
            out.stride(0),
            scale,
            int(causal),
        )
        if status != 0:
            raise RuntimeError(f"native prefill attention failed with status {status}")


def prefill_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """The spec in float32: top-left causal (or full) GQA attention, [q_len, num_heads,
    head_dim]."""
    attended = F.scaled_dot_product_attention(
        query.float().transpose(0, 1),
        key.float().transpose(0, 1),
        value.float().transpose(0, 1),
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return attended.transpose(0, 1)


def load_prefill_attention(march: str = "native") -> PrefillAttention | None:
    """The native kernel, or None where it cannot be built (see native_build). Tests pass
    an older `march` to check that non-AVX-512 builds decline (`supports` is False)."""
    library = load_bound("prefill_attention", _SIGNATURES, march)
    return PrefillAttention(library) if library is not None else None


@functools.cache
def _shared_kernel() -> PrefillAttention | None:
    return load_prefill_attention()


def full_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention over [N, H, L, D] (a vision tower's patches, scale
    D^-0.5), as torch SDPA computes it. bfloat16 on the CPU runs the native kernel where
    it is built (AVX-512), the heads padded with zeros to a multiple of 32 (zero dims add
    nothing to the scores; the padded value columns are dropped): at SigLIP's 16 heads of
    72 over 729 patches, 12.4 ms against torch SDPA's 21.2 (2 threads, Zen 4). In float32
    SDPA was as fast (20.3 against 23.0 ms), so float32 and every other case keep it."""
    native = _shared_kernel() if query.device.type == "cpu" else None
    head_dim = query.shape[-1]
    padded = -(-head_dim // 32) * 32
    if query.dtype != torch.bfloat16 or native is None or not native.runs_head_dim(padded):
        return F.scaled_dot_product_attention(query, key, value)
    rows = [
        F.pad(t.transpose(1, 2), (0, padded - head_dim)).contiguous() for t in (query, key, value)
    ]  # [N, L, H, padded] each
    out = torch.empty_like(rows[0])
    for n in range(query.shape[0]):
        native(rows[0][n], rows[1][n], rows[2][n], out[n], head_dim**-0.5, causal=False)
    return out[..., :head_dim].transpose(1, 2)
