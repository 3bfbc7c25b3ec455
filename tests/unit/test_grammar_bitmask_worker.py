"""The worker's bitmask application: xgrammar's CPU kernel, the torch reference and the
kernel module's reference agree, for a subset of rows and a padded LM head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.gpu_worker.grammar_bitmask import (
    apply_bitmask_cpu,
    apply_bitmask_ref,
    apply_grammar_bitmask,
    unpack_bitmask,
)
from kvflow.kernels.grammar_bitmask import apply_grammar_bitmask_ref
from kvflow.proto.step import GrammarBitmask

VOCAB = 100  # not a multiple of 32: the last word is partial


def random_mask(req_ids: list[str], vocab: int, seed: int) -> GrammarBitmask:
    words = (vocab + 31) // 32
    rng = np.random.default_rng(seed)
    data = rng.integers(-(2**31), 2**31, size=(len(req_ids), words), dtype=np.int64)
    return GrammarBitmask(req_ids, words, data.astype(np.int32).tobytes())


def expected(logits: torch.Tensor, req_ids: list[str], mask: GrammarBitmask) -> torch.Tensor:
    """Bit by bit, in Python: the spec of the spec."""
    out = logits.clone()
    bits = unpack_bitmask(mask)
    for i, req_id in enumerate(mask.req_ids):
        row = req_ids.index(req_id)
        for token in range(logits.shape[1]):
            word = int(bits[i, token // 32]) if token < mask.words_per_row * 32 else 0
            if not (word >> (token % 32)) & 1:  # past the mask's words: never allowed
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("width", [VOCAB, 4 * 32 + 28])  # + padded LM-head columns
def test_masks_only_the_listed_rows(width: int) -> None:
    req_ids = ["a", "b", "c", "d"]
    mask = random_mask(["d", "b"], VOCAB, seed=1)
    logits = torch.randn(4, width)
    want = expected(logits, req_ids, mask)
    apply_grammar_bitmask(logits, req_ids, mask)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_cpu_kernel_equals_references() -> None:
    mask = random_mask(["x", "y", "z"], VOCAB, seed=2)
    bitmask = unpack_bitmask(mask)
    rows = [4, 0, 2]
    base = torch.randn(5, VOCAB)
    cpu, ref, spec = base.clone(), base.clone(), base.clone()
    apply_bitmask_cpu(cpu, bitmask, rows, VOCAB)
    apply_bitmask_ref(ref, bitmask, rows, VOCAB)
    apply_grammar_bitmask_ref(spec, bitmask, torch.tensor(rows))
    torch.testing.assert_close(cpu, spec, rtol=0, atol=0)
    torch.testing.assert_close(ref, spec, rtol=0, atol=0)
    assert torch.isinf(spec).any() and torch.isfinite(spec[1]).all()  # row 1 untouched


def test_no_mask_is_a_no_op() -> None:
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    apply_grammar_bitmask(logits, ["a", "b"], None)
    assert torch.equal(logits, before)


def test_cpu_path_masks_nan_and_inf_and_keeps_allowed_values() -> None:
    """A disallowed logit is -inf whatever it was (NaN, +inf); an allowed one keeps its
    value (a NaN becomes +inf: it still wins argmax, as the NaN did)."""
    mask = random_mask(["x"], 64, seed=3)
    bitmask = unpack_bitmask(mask)
    allowed = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 == 1 for t in range(64)]
    logits = torch.randn(1, 64)
    logits[0, ::3] = float("nan")
    logits[0, 1::7] = float("inf")
    before = logits.clone()
    apply_bitmask_cpu(logits, bitmask, [0], 64)
    for token in range(64):
        value, was = float(logits[0, token]), float(before[0, token])
        if not allowed[token]:
            assert value == float("-inf"), token
        elif was != was:  # NaN
            assert value == float("inf"), token
        else:
            assert value == was, token


def test_cpu_path_bfloat16_equals_reference() -> None:
    mask = random_mask(["x", "y"], VOCAB, seed=4)
    bitmask = unpack_bitmask(mask)
    base = torch.randn(3, VOCAB).to(torch.bfloat16)
    cpu, ref = base.clone(), base.clone()
    apply_bitmask_cpu(cpu, bitmask, [2, 0], VOCAB)
    apply_bitmask_ref(ref, bitmask, [2, 0], VOCAB)
    assert torch.equal(cpu, ref)


def test_cpu_path_on_inference_mode_logits() -> None:
    """The worker's logits are inference tensors (execute runs under inference_mode)."""
    mask = random_mask(["a"], VOCAB, seed=5)
    with torch.inference_mode():
        logits = torch.randn(2, VOCAB)
        want = expected(logits, ["b", "a"], mask)
        apply_grammar_bitmask(logits[:2], ["b", "a"], mask)
    assert torch.equal(logits, want)
