"""A step that raises leaves the offline engine usable: the next generate() works."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow import LLM, SamplingParams


def test_generate_after_a_step_raised(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", num_blocks=64)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    free_when_idle = llm.engine.kv_cache.num_free_blocks

    runner = llm.engine.runner
    execute = runner.execute
    calls = 0

    def fail_on_third_step(plan: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:  # mid-generation: prompts done, some tokens sampled
            raise RuntimeError("injected step failure")
        return execute(plan)

    monkeypatch.setattr(runner, "execute", fail_on_third_step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompts, params)

    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_cache.check_integrity()
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.kv_cache.num_free_blocks == free_when_idle  # no block leaked


def test_a_vanishing_repetition_penalty_keeps_guided_sampling_valid(tiny_model_dir: Any) -> None:
    # Found by the API fuzzer: 5e-324 is 0 in float32, and dividing positive logits by
    # it made them inf, the softmax NaN, and the sample fall outside the grammar.
    from kvflow.sampling_params import StructuredOutputsParams

    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", num_blocks=64)
    params = SamplingParams(
        max_tokens=8,
        repetition_penalty=5e-324,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    outputs = llm.generate([[1, 2, 3, 4], [5, 6, 7]], params)
    assert all(o.finish_reason != "error" for o in outputs), outputs
    assert all(o.text in ("yes", "no") for o in outputs), [o.text for o in outputs]
