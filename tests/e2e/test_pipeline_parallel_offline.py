"""`LLM(pipeline_parallel_size=2)`, TP=2 x PP=2 and PP=3: greedy tokens equal one
process's.

The model has 3 layers, so 2 stages split them unevenly (2 + 1 by default, 1 + 2 with
`pp_layer_partition`), and 3 stages have a middle one. It is the uneven Qwen2 of the TP test (1 KV head, an odd
vocabulary) so that TP=2 x PP=2 also pads and replicates. The workload goes through the
paths where stages must agree: chunked prefill (a 16-token budget), prefix-cache hits
(the second batch shares the first's prefix), preemption (8 blocks of 8 tokens), n > 1
and a stop string; with P micro-batches in flight (micro_batches.py's rules).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from parallel_models import FIRST, SECOND, save_uneven_qwen2

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = dict(
    dtype="float32",
    device="cpu",
    num_threads=1,
    num_blocks=8,
    block_size=8,
    max_num_batched_tokens=16,
)


@pytest.fixture(scope="module")
def three_layer_model_dir(
    tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path
) -> Path:
    """Qwen2, 3 layers, 1 KV head for 4 query heads, vocabulary = tokenizer + 1 (odd)."""
    return save_uneven_qwen2(tmp_path_factory.mktemp("tiny-3-layers"), embedded_model_dir, 3)


def _run(model_dir: Path, stop: str | None, **parallel: Any) -> tuple[list[Any], int, int]:
    """Both batches' (text, token ids, finish reason) per sample; prefix-hit tokens and
    preemptions."""
    llm = LLM(str(model_dir), **ENGINE, **parallel)  # type: ignore[arg-type]
    try:
        params = [
            SamplingParams(temperature=0.0, max_tokens=10, n=2),
            SamplingParams(temperature=0.0, max_tokens=12, stop=[stop] if stop else None),
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        ]
        results = []
        for prompts in (FIRST, SECOND):
            for output in llm.generate(prompts, params):
                results.append(
                    [(c.text, list(c.token_ids), c.finish_reason) for c in output.outputs]
                )
        engine = llm.engine
        return results, engine.kv_cache.prefix_cache_hits, engine.scheduler.num_preemptions
    finally:
        llm.close()


@pytest.fixture(scope="module")
def reference(three_layer_model_dir: Path) -> tuple[str, list[Any]]:
    """(stop string, one process's outputs with it)."""
    probe, _, _ = _run(three_layer_model_dir, None)
    hello_text = probe[1][0][0]
    stop = hello_text[len(hello_text) // 2 :][:3]  # a piece from the middle of an output
    assert stop.strip(), hello_text
    want, hits, preemptions = _run(three_layer_model_dir, stop)
    assert want[1][0][2] == "stop"  # the stop string cut the output
    assert len(want[0]) == 2  # n = 2
    assert hits > 0 and preemptions > 0
    return stop, want


@pytest.mark.parametrize(
    "parallel",
    [
        {"pipeline_parallel_size": 2},  # layers 2 + 1
        {"pipeline_parallel_size": 2, "pp_layer_partition": "1,2"},
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
        {"pipeline_parallel_size": 3},  # a middle stage: receives and sends
    ],
    ids=["pp2", "pp2-partition-1-2", "tp2xpp2", "pp3"],
)
def test_pipeline_greedy_equals_one_process(
    three_layer_model_dir: Path, reference: tuple[str, list[Any]], parallel: dict[str, Any]
) -> None:
    stop, want = reference
    got, hits, preemptions = _run(three_layer_model_dir, stop, **parallel)
    assert got == want
    assert hits > 0 and preemptions > 0  # the paths ran with micro-batches in flight
    assert multiprocessing.active_children() == []


def test_a_partition_that_does_not_sum_is_refused_before_any_process(
    three_layer_model_dir: Path,
) -> None:
    from kvflow.errors import ConfigError

    with pytest.raises(ConfigError, match="sum to the model's 3 layers"):
        LLM(
            str(three_layer_model_dir), pipeline_parallel_size=2, pp_layer_partition="2,2", **ENGINE
        )  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []


def test_a_killed_stage_fails_generate_fast_and_leaves_no_process(
    three_layer_model_dir: Path,
) -> None:
    from kvflow.errors import EngineDeadError

    llm = LLM(str(three_layer_model_dir), pipeline_parallel_size=2, **ENGINE)  # type: ignore[arg-type]
    try:
        first_stage = llm.engine.executor._children.children[0].process
        os.kill(first_stage.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker rank"):
            llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=50))
        assert time.monotonic() - start < 10.0
    finally:
        llm.close()
    assert multiprocessing.active_children() == []


def test_guided_decoding_with_jump_forward_equals_one_process(three_layer_model_dir: Path) -> None:
    """Grammar bitmasks and forced tokens (jump-forward, which travel in the plan beside
    the sampled tokens a first stage is told) with two stages in flight."""
    from test_jump_forward import CONSTRAINTS, PROMPTS, _params

    def run(**parallel: Any) -> tuple[list[list[int]], int]:
        llm = LLM(str(three_layer_model_dir), **{**ENGINE, "num_blocks": 64}, **parallel)  # type: ignore[arg-type]
        try:
            outputs = llm.generate(PROMPTS, [_params(c) for c in CONSTRAINTS])
            jumped = llm.engine.scheduler.num_jump_forward_tokens
            return [list(o.outputs[0].token_ids) for o in outputs], jumped
        finally:
            llm.close()

    want, want_jumped = run()
    got, got_jumped = run(pipeline_parallel_size=2)
    assert got == want
    assert got_jumped == want_jumped > 0
