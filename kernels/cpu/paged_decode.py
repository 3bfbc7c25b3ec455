"""Launcher of the native paged decode attention (paged_decode_attention.cpp).

Decode only: every request has exactly one query token (its last position), which
attends its whole context read in place from the paged cache. The torch reference is
the decode path of gpu_worker/attention/torch_backend.py.
"""

from __future__ import annotations

import ctypes

import torch

from kvflow.kernels import kv_codec
from kvflow.kernels.cpu import native_calls
from kvflow.kernels.cpu.native_build import DTYPE_CODES, INT64, POINTER, cpu_flags, load_bound

_SIGNATURE = [ctypes.c_int, *[POINTER] * 7, INT64, POINTER, *[INT64] * 8, ctypes.c_float]
_QUANT_SIGNATURE = [ctypes.c_int, *_SIGNATURE]

# storage dtype of a quantized cache -> the kernel's codec number
CODEC_CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_INDEX_NAMES = ("block_tables", "seq_lens", "req_indices", "token_rows")


class PagedDecodeAttention:
    """The compiled kernel behind a shape-checking call; see `load_paged_decode`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.kvflow_paged_decode_attention
        self._quant_fn = library.kvflow_paged_decode_attention_quant

    @staticmethod
    def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """A CPU float32/bfloat16 query over a cache of the same dtype or a quantized
        cache (kv_codec's format; the output is in the query's dtype)."""
        return (
            query.device.type == "cpu"
            and query.dtype in DTYPE_CODES
            and (kv_cache.dtype == query.dtype or kv_cache.dtype in CODEC_CODES)
        )

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
        seq_lens: torch.Tensor,  # [num_reqs] int32, context incl. the query token
        req_indices: torch.Tensor,  # [num_decodes] int32: the request of each decode
        token_rows: torch.Tensor,  # [num_decodes] int32: its query row in `query`
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows token_rows written
        scale: float,
        window: int | None = None,
        indices_checked: bool = False,
    ) -> None:
        """`indices_checked`: the caller ran `check_indices` on these index tensors (once
        per step rather than once per layer). A quantized kv_cache holds rows of
        head_dim + 4 (kv_codec)."""
        indices = (block_tables, seq_lens, req_indices, token_rows)
        check_layout(query, kv_cache, out, indices)
        _, num_heads, head_dim = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        dtype = query.dtype
        codec = CODEC_CODES.get(kv_cache.dtype)
        if not indices_checked:
            check_indices(
                query.shape[0], block_tables, seq_lens, req_indices, token_rows, block_size
            )
        k_ptr = kv_cache.data_ptr()
        lead = (DTYPE_CODES[dtype],) if codec is None else (DTYPE_CODES[dtype], codec)
        status = native_calls.run(
            self._fn if codec is None else self._quant_fn,
            *lead,
            query.data_ptr(),
            k_ptr,
            k_ptr + kv_cache.stride(0) * kv_cache.element_size(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            req_indices.data_ptr(),
            token_rows.data_ptr(),
            req_indices.shape[0],
            out.data_ptr(),
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            block_tables.shape[1],
            query.stride(0),
            out.stride(0),
            window or 0,
            scale,
        )
        if status != 0:
            raise RuntimeError(f"native paged decode attention failed with status {status}")


def check_layout(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    indices: tuple[torch.Tensor, ...],  # block_tables, seq_lens, req_indices, token_rows
) -> None:
    """The dtypes, shapes and strides the kernel assumes; anything else is a ValueError."""
    _, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, row = kv_cache.shape
    dtype = query.dtype
    codec = CODEC_CODES.get(kv_cache.dtype)
    if query.device.type != "cpu" or dtype not in DTYPE_CODES:
        raise ValueError(f"CPU float32/bfloat16 only, got {dtype} on {query.device}")
    if (kv_cache.dtype != dtype and codec is None) or out.dtype != dtype:
        raise ValueError("query, out and a float kv_cache must share one dtype")
    cache_head_dim = kv_codec.row_width_to_head_dim(row, kv_cache.dtype)
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} heads of {head_dim} vs cache {kv_cache.shape}")
    q_strides, out_strides = query.stride(), out.stride()
    if q_strides[1:] != (head_dim, 1) or out_strides[1:] != (head_dim, 1):
        raise ValueError("query and out must have contiguous [heads, head_dim] rows")
    # Strides rather than kv_cache[0].is_contiguous(): a view costs more than the
    # kernel's whole call at batch 1.
    slot = num_kv_heads * row
    if kv_cache.stride()[1:] != (block_size * slot, slot, row, 1):
        raise ValueError("each of K and V of kv_cache must be contiguous")
    for name, t in zip(_INDEX_NAMES, indices):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor")


def paged_decode_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    req_indices: torch.Tensor,
    token_rows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> None:
    """The spec, one decode at a time in float32: query row token_rows[i] of request
    req_indices[i] attends positions max(0, L - window) .. L - 1 of its context. A
    quantized cache is read as kv_codec.dequantize_rows decodes it."""
    if kv_codec.is_quantized(kv_cache.dtype):
        kv_cache = kv_codec.dequantize_rows(kv_cache)
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    for req, row in zip(req_indices.tolist(), token_rows.tolist()):
        seq_len = int(seq_lens[req])
        positions = torch.arange(seq_len)
        if window:
            positions = positions[max(0, seq_len - window) :]
        slots = block_tables[req].long()[positions // block_size] * block_size
        slots += positions % block_size
        k = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots].float()  # [n, KH, D]
        v = kv_cache[1].reshape(-1, num_kv_heads, head_dim)[slots].float()
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[row].float(), k) * scale
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(out.dtype)


def check_indices(
    num_query_rows: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    req_indices: torch.Tensor,
    token_rows: torch.Tensor,
    block_size: int,
) -> None:
    """Indices the kernel follows unchecked: out of range here would be a wild read."""
    if req_indices.shape != token_rows.shape or req_indices.dim() != 1:
        raise ValueError("req_indices and token_rows must be 1-D, one entry per decode")
    if seq_lens.shape != block_tables.shape[:1]:
        raise ValueError("seq_lens must have one entry per block-table row")
    if req_indices.numel() == 0:
        return
    if not (int(req_indices.min()) >= 0 and int(req_indices.max()) < block_tables.shape[0]):
        raise ValueError("req_indices out of range of block_tables")
    if not (int(token_rows.min()) >= 0 and int(token_rows.max()) < num_query_rows):
        raise ValueError("token_rows out of range of query")
    lens = seq_lens[req_indices.long()]
    check_lengths(int(lens.min()), int(lens.max()), block_tables.shape[1], block_size)


def check_lengths(shortest: int, longest: int, table_width: int, block_size: int) -> None:
    """Decode contexts the kernel reads through block tables `table_width` blocks wide."""
    if shortest < 1 or longest > table_width * block_size:
        raise ValueError("a decode's seq_len is below 1 or beyond its block table")


def load_paged_decode(march: str = "native") -> PagedDecodeAttention | None:
    """The native kernel, or None where it cannot be built (see native_build). Tests pass
    an older `march` to run the paths of CPUs without AVX512_BF16 or AVX-512."""
    signatures = {
        "kvflow_paged_decode_attention": _SIGNATURE,
        "kvflow_paged_decode_attention_quant": _QUANT_SIGNATURE,
    }
    library = load_bound("paged_decode_attention", signatures, march)
    return PagedDecodeAttention(library) if library is not None else None


def load_portable_paged_decode() -> PagedDecodeAttention | None:
    """The kernel built for AVX2 (-march=x86-64-v3: its portable f32x8 loops, what CPUs
    without AVX-512 run), where this CPU can run it; for benchmarks against native."""
    if not {"avx2", "fma", "bmi2", "movbe"} <= cpu_flags():
        return None
    return load_paged_decode("x86-64-v3")
