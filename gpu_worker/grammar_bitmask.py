"""Guided decoding on the worker: apply the step's packed grammar bitmask to the logits.

The scheduler sends one bitmask row per guided request that samples this step
(`StepPlan.grammar_bitmask`, xgrammar's layout: token 32w + j is bit j of int32 word w,
1 = allowed). Disallowed tokens get -inf before the sampler runs, so sampling, greedy
argmax and the returned logprobs all see the masked distribution. Columns past the
mask's vocabulary (padded ids of a wider LM head) are never allowed.

Paths: CUDA logits use kvflow's Triton kernel (`kernels/grammar_bitmask.py`); CPU
logits use the vectorised table lookup below (`apply_bitmask_cpu`), 4-9x faster than
xgrammar's own CPU kernel at 32 rows of a 49152-token vocabulary (docs/benchmarks.md);
`apply_bitmask_ref` is the spec. They compute the same thing
(tests/unit/test_grammar_bitmask_worker.py).
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.proto.step import GrammarBitmask


def unpack_bitmask(mask: GrammarBitmask) -> torch.Tensor:
    """The rows as an int32 tensor [len(req_ids), words_per_row] (CPU)."""
    data = torch.frombuffer(bytearray(mask.data), dtype=torch.int32)
    return data.view(len(mask.req_ids), mask.words_per_row)


def apply_grammar_bitmask(
    logits: torch.Tensor,  # [num_rows, vocab] fp32, modified in place
    req_ids: list[str],  # the request of each logits row
    mask: GrammarBitmask | None,
) -> None:
    """Mask the rows of the requests that have a bitmask row this step."""
    if mask is None or not mask.req_ids:
        return
    row_of = {req_id: row for row, req_id in enumerate(req_ids)}
    rows = [row_of[req_id] for req_id in mask.req_ids]
    bitmask = unpack_bitmask(mask)  # [n, words]
    mask_vocab = mask.words_per_row * 32
    if logits.shape[1] > mask_vocab:  # padded LM-head columns: never a valid token
        logits[rows, mask_vocab:] = float("-inf")
    vocab = min(logits.shape[1], mask_vocab)
    if logits.is_cuda:
        from kvflow.kernels.grammar_bitmask import apply_grammar_bitmask as triton_apply

        words = (vocab + 31) // 32
        indices = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        target = logits if vocab == logits.shape[1] else logits[:, :vocab]
        triton_apply(target, bitmask[:, :words].to(logits.device).contiguous(), indices)
        return
    apply_bitmask_cpu(logits, bitmask, rows, vocab)


# Byte b of a mask word covers 8 tokens; _BOUNDS[b, j] is +inf where bit j of b is set
# (allowed) and -inf where it is not. fmin(logit, bound) then leaves an allowed logit as
# it is and makes a disallowed one -inf, NaN included (fmin ignores a NaN operand).
_BITS = (np.arange(256)[:, None] >> np.arange(8)) & 1  # [256, 8]
_BOUNDS = np.where(_BITS == 1, np.inf, -np.inf).astype(np.float32)


def apply_bitmask_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int
) -> None:
    """One table lookup per mask byte and one fmin per row: no per-bit loop.

    The only difference from the reference: an allowed NaN logit becomes +inf (fmin
    ignores the NaN); it still wins argmax, as the NaN did, and a disallowed logit is
    -inf whatever it was, which is what the grammar needs.
    """
    mask_bytes = bitmask.numpy().view(np.uint8)  # little-endian: byte k = tokens 8k..8k+7
    bounds = np.take(_BOUNDS, mask_bytes, axis=0).reshape(len(rows), -1)[:, :vocab]
    if logits.dtype == torch.float32:
        out = logits.numpy()  # shares memory: the fmin writes into the logits
        for i, row in enumerate(rows):
            np.fmin(out[row, :vocab], bounds[i], out=out[row, :vocab])
        return
    for i, row in enumerate(rows):  # bf16/fp16 logits: numpy has no bf16
        target = logits[row, :vocab]
        target.copy_(torch.fmin(target, torch.from_numpy(bounds[i]).to(logits.dtype)))


def apply_bitmask_ref(
    logits: torch.Tensor,  # [num_rows, >= vocab]
    bitmask: torch.Tensor,  # [len(rows), ceil(vocab / 32)] int32
    rows: list[int],
    vocab: int,
) -> None:
    """Reference (the spec): unpack every bit, -inf where it is 0."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool()  # [n, words, 32]
    allowed = allowed.flatten(1)[:, :vocab]  # [n, vocab]
    index = torch.tensor(rows, dtype=torch.int64)
    selected = logits.index_select(0, index)  # [n, >= vocab]
    selected[:, :vocab].masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index.to(logits.device), selected)
