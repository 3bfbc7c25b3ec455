"""Grammar bitmask application against its reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels.grammar_bitmask import apply_grammar_bitmask, apply_grammar_bitmask_ref

VOCAB = 100  # not a multiple of 32: the last word is partly beyond the vocabulary


def _random_bitmask(num_rows: int, gen: torch.Generator) -> torch.Tensor:
    # Full int32 range: words with bit 31 set are negative, which must still unpack right.
    words = torch.randint(-(2**31), 2**31 - 1, (num_rows, 4), generator=gen, dtype=torch.int64)
    return words.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_indices", [False, True])
def test_apply_bitmask(device, dtype, with_indices):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen).to(dtype).to(device)
    if with_indices:  # masks for logits rows 3 and 1 only; rows 0 and 2 stay untouched
        bitmask = _random_bitmask(2, gen).to(device)
        indices = torch.tensor([3, 1], device=device)
    else:
        bitmask, indices = _random_bitmask(4, gen).to(device), None
    expected = logits.clone()
    apply_grammar_bitmask(logits, bitmask, indices)
    apply_grammar_bitmask_ref(expected, bitmask, indices)
    assert torch.equal(logits, expected)
    masked = torch.isinf(logits).sum().item()
    assert 0 < masked < logits.numel()


def test_bitmask_bit_layout(device):
    # Token 32w + j is bit j of word w: allow exactly tokens 0, 33 and 99.
    logits = torch.zeros(1, VOCAB, device=device)
    bitmask = torch.zeros(1, 4, dtype=torch.int32, device=device)
    bitmask[0, 0], bitmask[0, 1], bitmask[0, 3] = 1, 2, 1 << 3
    apply_grammar_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 33, 99]
