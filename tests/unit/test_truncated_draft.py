"""The self-speculative draft of `kvflow bench spec-decode --draft-layers N`: the target's
first N layers with its embedding, norm and head; and the bench's step-cost arithmetic."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open

from kvflow.bench.spec_decode import SpecResult
from kvflow.bench.truncated_draft import truncated_copy


def test_truncated_copy_keeps_the_first_layers(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tiny_model_dir("llama")
    dst = truncated_copy(src, tmp_path / "first1", 1)
    assert json.loads((dst / "config.json").read_text())["num_hidden_layers"] == 1
    assert (dst / "tokenizer.json").is_file()
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        kept = set(f.keys())
    assert kept == {n for n in names if ".layers.1." not in n}
    assert any(".layers.0." in n for n in kept) and "model.norm.weight" in kept
    assert truncated_copy(src, dst, 1) == dst  # written once
    with pytest.raises(ValueError):
        truncated_copy(src, tmp_path / "all", 2)


def test_step_cost_is_tokens_per_step_over_the_decode_speedup() -> None:
    # Two requests of 11 tokens each, 0.5 s of prefill in all (both configurations pay
    # it alike). Plain decoding: 20 decode tokens in 2.0 s (10 tok/s). Speculation: 10
    # verification steps of k = 4 emitting 2 tokens each, in 4/3 s (15 tok/s, 1.5x): a
    # verification step cost 2 / 1.5 plain steps; break-even (c - 1) / k.
    plain = SpecResult("none", 0, False, 22, 2.5, requests=2, first_token_s=0.5)
    spec = SpecResult("ngram", 4, True, 22, 0.5 + 4 / 3, 10, 40, 10, 2, 0.5)
    summary = spec.summary(baseline=plain)
    assert summary["decode_tokens_per_s"] == pytest.approx(15.0, abs=1e-2)
    assert summary["decode_speedup"] == pytest.approx(1.5, abs=1e-3)
    # End to end the prefill dilutes the gain: 22 / 1.833 s against 22 / 2.5 s.
    assert summary["speedup"] == pytest.approx(2.5 / (0.5 + 4 / 3), abs=1e-3)
    assert summary["mean_acceptance_length"] == 2.0
    assert summary["step_cost"] == pytest.approx(2 / 1.5, abs=1e-3)
    assert summary["break_even"] == pytest.approx((2 / 1.5 - 1) / 4, abs=1e-3)
    assert "step_cost" not in SpecResult("ngram", 4, False, 22, 1.0, 10, 40, 10, 2).summary(plain)
