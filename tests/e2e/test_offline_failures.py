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


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def _raise_on_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, call: int) -> None:
    """`owner.name` raises on its `call`-th call, then works again."""
    original = getattr(owner, name)
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == call:
            raise RuntimeError(f"injected {name} failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.parametrize("where", ["core.update", "streams.process", "executor.submit"])
def test_a_failure_anywhere_in_an_async_step_leaves_the_engine_usable(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # Two steps in flight: a result waits in the executor when the step fails.
    llm = LLM(
        str(tiny_model_dir("llama")),
        device="cpu",
        dtype="float32",
        num_blocks=64,
        async_scheduling=True,
    )
    expected = _greedy(llm)
    owner_name, name = where.split(".")
    _raise_on_call(monkeypatch, getattr(llm.engine, owner_name), name, 3)
    with pytest.raises(RuntimeError, match="injected"):
        _greedy(llm)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.executor.num_in_flight == 0
    llm.engine.kv_cache.check_integrity()
    assert _greedy(llm) == expected


def test_engine_step_that_raises_fails_its_requests_and_steps_on(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Driven by `LLMEngine.step` directly (no LLM.generate to clean up): the step that
    raised fails the unfinished requests; the engine does not spin on a lost result."""
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", num_blocks=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = _greedy(llm)[0]
    _raise_on_call(monkeypatch, engine.runner, "execute", 3)
    engine.add_request("failing", [1, 2, 3, 4], params)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(50):
            engine.step()
    assert not engine.has_unfinished_requests()
    engine.add_request("next", [1, 2, 3, 4], params)
    finished = []
    for _ in range(50):  # bounded: a lost result used to make this loop forever
        finished += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert [list(o.outputs[0].token_ids) for o in finished] == [expected]
    engine.kv_cache.check_integrity()


@pytest.mark.slow
def test_a_failed_step_leaves_a_worker_group_usable(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor parallelism: the ranks drop their batches together (a hello) and serve
    the next generate() with the tokens a fresh engine gives."""
    import multiprocessing

    model = str(tiny_model_dir("llama"))
    engine = dict(device="cpu", dtype="float32", num_blocks=64, num_threads=1)
    llm = LLM(model, tensor_parallel_size=2, async_scheduling=True, **engine)  # type: ignore[arg-type]
    try:
        expected = _greedy(llm)
        _raise_on_call(monkeypatch, llm.engine.core, "update", 3)
        with pytest.raises(RuntimeError, match="injected"):
            _greedy(llm)
        assert not llm.engine.has_unfinished_requests()
        assert _greedy(llm) == expected
    finally:
        llm.close()
    assert multiprocessing.active_children() == []


UNGUARDED_SCRIPT = """
from kvflow import LLM

llm = LLM({model!r}, tensor_parallel_size=2, device="cpu", dtype="float32", num_blocks=64)
print("generated", llm.generate("Hello").pop().outputs[0].token_ids)
"""


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_to_add_one(
    tiny_model_dir: Any, tmp_path: Any
) -> None:
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT.format(model=str(tiny_model_dir("llama"))))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode == 1
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("kvflow.services.launch.children.LaunchError: "), done.stderr
    assert 'under `if __name__ == "__main__":` in ' + str(script) in last_line
    assert "exited with code" not in done.stderr
