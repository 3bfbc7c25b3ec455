"""The CPU step flushes denormals, and leaves the process's float semantics as it found
them (an offline `LLM` runs in the user's own process)."""

from __future__ import annotations

from typing import Any

import torch

from kvflow import LLM, SamplingParams
from kvflow.gpu_worker.denormals import denormals_are_flushed, flushed_denormals


def test_flushed_inside_and_restored_after() -> None:
    assert not denormals_are_flushed()
    with flushed_denormals():
        assert denormals_are_flushed()
    assert not denormals_are_flushed()
    with flushed_denormals(enabled=False):
        assert not denormals_are_flushed()


def test_a_flag_set_before_is_left_set() -> None:
    torch.set_flush_denormal(True)
    try:
        with flushed_denormals():
            pass
        assert denormals_are_flushed()
    finally:
        torch.set_flush_denormal(False)


def test_offline_generation_leaves_subnormals_alone(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", num_blocks=16)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 3
    assert not denormals_are_flushed()
