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


def test_step_cost_is_tokens_per_step_over_speedup() -> None:
    # 10 verification steps of k = 4 emitting 2 tokens each, at 1.5x the plain tok/s:
    # a verification step cost 2 / 1.5 plain steps; break-even (c - 1) / k.
    result = SpecResult("ngram", 4, True, 20, 1.0, 10, 40, 10)
    summary = result.summary(baseline=20 / 1.5)
    assert summary["mean_acceptance_length"] == 2.0
    assert summary["step_cost"] == pytest.approx(2 / 1.5, abs=1e-3)
    assert summary["break_even"] == pytest.approx((2 / 1.5 - 1) / 4, abs=1e-3)
    assert "step_cost" not in SpecResult("ngram", 4, False, 20, 1.0, 10, 40, 10).summary(10.0)
