"""`LLM(tensor_parallel_size=2)`: two worker processes (gloo) give TP=1's greedy tokens.

The workload goes through the scheduler's paths that a rank must follow in lockstep:
chunked prefill (a 16-token budget cuts the long prompts), prefix-cache hits (a second
batch shares the first's prefix), n > 1, and stop strings, on an uneven Qwen2 (1 KV
head, replicated on both ranks; vocabulary odd, so the last rank's LM-head rows are
padding; q|k|v biases split like their matrices).
"""

from __future__ import annotations

from collections.abc import Callable
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
    num_blocks=96,
    max_num_batched_tokens=16,
)


@pytest.fixture(scope="module")
def uneven_model_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model_dir: Path) -> Path:
    """Qwen2, 1 KV head for 4 query heads, vocabulary = tokenizer + 1 (odd)."""
    return save_uneven_qwen2(tmp_path_factory.mktemp("tiny-uneven"), embedded_model_dir, 2)


def _run(model_dir: Path, tp: int, stop: str | None) -> tuple[list[Any], int]:
    """Both batches' (text, token ids, finish reason) per sample; prefix-hit tokens."""
    llm = LLM(str(model_dir), tensor_parallel_size=tp, **ENGINE)  # type: ignore[arg-type]
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
        return results, llm.engine.kv_cache.prefix_cache_hits
    finally:
        llm.close()


def test_tp2_greedy_equals_tp1_on_uneven_shapes(uneven_model_dir: Path) -> None:
    # The even case (2 KV heads, one per rank) is served in
    # tests/integration/test_serve_tensor_parallel.py; this one pads and replicates.
    model_dir = uneven_model_dir
    probe, _ = _run(model_dir, 1, None)
    hello_text = probe[1][0][0]
    stop = hello_text[len(hello_text) // 2 :][:3]  # a piece from the middle of an output
    assert stop.strip(), hello_text
    want, want_hits = _run(model_dir, 1, stop)
    got, got_hits = _run(model_dir, 2, stop)
    assert got == want
    assert want[1][0][2] == "stop"  # the stop string cut the output
    assert len(want[0]) == 2  # n = 2
    assert got_hits == want_hits > 0  # the second batch hit the first one's prefix


def test_a_model_that_does_not_split_fails_before_any_rank_starts(
    tmp_path: Path, embedded_model_dir: Path
) -> None:
    """3 query heads over 2 ranks: refused from the config with the sizes that fit, and
    no worker process is left behind (none started)."""
    import multiprocessing

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvflow.errors import KvflowError

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(
        KvflowError,
        match=r"tensor_parallel_size=2 must divide the model's 3 attention heads.*"
        r"sizes that fit: 1$",
    ):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE)  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []


def test_a_rank_that_fails_to_start_is_named(tiny_model_dir: Callable[[str], Path]) -> None:
    """A failure only a rank finds (its KV cache does not fit): the rank and the reason,
    and no worker process left behind."""
    import multiprocessing

    from kvflow.errors import KvflowError

    engine = {**ENGINE, "kv_cache_memory": 1e-9}
    del engine["num_blocks"]  # sized from kv_cache_memory
    with pytest.raises(KvflowError, match=r"worker rank \d failed to start: KV cache memory"):
        LLM(str(tiny_model_dir("llama")), tensor_parallel_size=2, **engine)  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []


def test_a_killed_rank_fails_generate_fast_and_leaves_no_process(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    import multiprocessing
    import os
    import signal
    import time

    from kvflow.errors import EngineDeadError

    llm = LLM(str(tiny_model_dir("llama")), tensor_parallel_size=2, **ENGINE)  # type: ignore[arg-type]
    try:
        rank1 = llm.engine.executor._children.children[1].process
        os.kill(rank1.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker rank"):
            llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=50))
        assert time.monotonic() - start < 10.0
    finally:
        llm.close()
    assert multiprocessing.active_children() == []
