"""Apply a packed grammar bitmask to logits in place (guided decoding).

Word w of a bitmask row packs tokens 32w .. 32w+31, token 32w + j in bit j (bit 1 =
allowed, the xgrammar layout). A disallowed token's logit becomes -inf; allowed logits
are left untouched (the kernel never even reads them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.launch_utils import (
    FLOAT_DTYPES,
    assert_last_dim_contiguous,
    check_device,
    next_pow2,
)

_MAX_BLOCK_V = 4096


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [num_rows, vocab]
    bitmask_ptr,  # [num_masks, ceil(vocab / 32)] int32
    indices_ptr,  # [num_masks] int64 logits row of each mask row (HAS_INDICES)
    stride_l,
    stride_b,
    vocab,
    HAS_INDICES: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    mask_row = tl.program_id(0)
    if HAS_INDICES:
        logits_row = tl.load(indices_ptr + mask_row).to(tl.int64)
    else:
        logits_row = mask_row.to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] token ids
    in_vocab = offs < vocab
    words = tl.load(bitmask_ptr + mask_row * stride_b + offs // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0  # arithmetic shift is fine: we keep bit 0
    neg_inf = tl.full([BLOCK_V], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + logits_row * stride_l + offs, neg_inf, mask=in_vocab & ~allowed)


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab], modified in place
    bitmask: torch.Tensor,  # [num_masks, ceil(vocab / 32)] int32
    indices: torch.Tensor | None = None,  # [num_masks] int: logits row of each mask row
) -> None:
    """Set logits[indices[i], t] = -inf where bit t of bitmask[i] is 0 (indices defaults
    to 0..num_masks-1, i.e. one mask row per logits row)."""
    num_rows, vocab = logits.shape
    num_masks, num_words = bitmask.shape
    assert num_words == triton.cdiv(vocab, 32), (bitmask.shape, logits.shape)
    assert bitmask.dtype == torch.int32 and logits.dtype in FLOAT_DTYPES
    if indices is None:
        assert num_masks == num_rows, (bitmask.shape, logits.shape)
    else:
        assert indices.shape == (num_masks,) and not indices.is_floating_point()
    assert_last_dim_contiguous("logits", logits)
    assert_last_dim_contiguous("bitmask", bitmask)
    check_device(_apply_bitmask_kernel, logits, bitmask)
    if num_masks == 0:
        return
    block_v = min(_MAX_BLOCK_V, next_pow2(vocab))
    _apply_bitmask_kernel[(num_masks, triton.cdiv(vocab, block_v))](
        logits, bitmask, bitmask if indices is None else indices,
        logits.stride(0), bitmask.stride(0), vocab,
        HAS_INDICES=indices is not None, BLOCK_V=block_v,
    )  # fmt: skip


def apply_grammar_bitmask_ref(
    logits: torch.Tensor,  # [num_rows, vocab], modified in place
    bitmask: torch.Tensor,  # [num_masks, ceil(vocab / 32)] int32
    indices: torch.Tensor | None = None,  # [num_masks]
) -> None:
    """Reference (the spec): unpack the bits and mask row by row."""
    vocab = logits.shape[1]
    rows = range(bitmask.shape[0]) if indices is None else indices.tolist()
    bits = torch.arange(32, device=bitmask.device)
    for i, row in enumerate(rows):
        unpacked = (bitmask[i, :, None] >> bits) & 1  # [num_words, 32]
        allowed = unpacked.flatten()[:vocab].bool()
        logits[row].masked_fill_(~allowed, float("-inf"))
