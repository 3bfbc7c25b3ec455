"""LoRA offline: kvflow's greedy tokens equal PEFT's, for base and adapter requests
mixed in one batch, through every scheduler path that touches them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lora_adapters import MAX_TOKENS, PROMPTS

from kvflow import LLM, LoRARequest, SamplingParams

ENGINE: dict[str, Any] = dict(dtype="float32", device="cpu", num_threads=1, enable_lora=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
Reference = dict[str | None, list[list[int]]]


def _requests(adapters: dict[str, Path]) -> dict[str | None, LoRARequest | None]:
    ids = {"a1": 1, "a2": 2}
    return {None: None, **{n: LoRARequest(n, ids[n], str(p)) for n, p in adapters.items()}}


def _interleaved(
    llm: LLM, adapters: dict[str, Path], reference: Reference, **kwargs: Any
) -> list[list[int]]:
    """Base, a1 and a2 requests interleaved in one generate() call; checked vs PEFT."""
    loras = _requests(adapters)
    order = [None, "a1", "a2", "a1", None, "a2"]
    prompts = [PROMPTS[i % 2] for i in range(len(order))]
    outputs = llm.generate(prompts, GREEDY, lora_request=[loras[name] for name in order], **kwargs)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    want = [reference[name][i % 2] for i, name in enumerate(order)]
    assert got == want
    return got


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(max_loras=2), id="two-slots"),
        pytest.param(dict(max_loras=1, max_cpu_loras=1), id="one-slot-waits"),
        pytest.param(dict(max_loras=2, max_num_batched_tokens=8), id="chunked-prefill"),
        pytest.param(dict(max_loras=2, async_scheduling=True), id="async"),
        pytest.param(dict(max_loras=2, enforce_eager=True), id="eager"),
        pytest.param(
            dict(
                max_loras=2,
                speculative_config={
                    "method": "ngram",
                    "num_speculative_tokens": 3,
                    "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3,
                },
            ),
            id="spec-ngram",
        ),
    ],
)
def test_mixed_batch_equals_peft(
    lora_base: Path, lora_adapters: dict[str, Path], peft_reference: Reference,
    options: dict[str, Any],
) -> None:  # fmt: skip
    llm = LLM(str(lora_base), **ENGINE, num_blocks=64, max_lora_rank=8, **options)
    _interleaved(llm, lora_adapters, peft_reference)
    graphs = llm.engine.runner.decode_graphs
    if graphs is not None and "speculative_config" not in options:
        # Decode steps with adapters were recorded (and replayed) as CPU graphs of their
        # own: a tape per (size, adapted), the same tokens as PEFT's.
        assert any(adapted for _, adapted in graphs.tapes)  # type: ignore[union-attr]
    # A decode step of the base alone afterwards still runs the base (slots are kept).
    assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)] == peft_reference[
        None
    ]


def test_after_preemption(
    lora_base: Path, lora_adapters: dict[str, Path], peft_reference: Reference
) -> None:
    # 12 blocks of 4 tokens for six requests of up to 26 tokens: admitted prompts fill
    # the cache, decodes need more, the newest are preempted and recomputed.
    llm = LLM(str(lora_base), **ENGINE, num_blocks=12, block_size=4, max_loras=2, max_lora_rank=8)
    _interleaved(llm, lora_adapters, peft_reference)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_is_per_adapter(
    lora_base: Path, lora_adapters: dict[str, Path], peft_reference: Reference
) -> None:
    """The same prompt under a1, a2 and the base: each its own answer, no hit across
    adapters; the same adapter again hits its own blocks."""
    llm = LLM(str(lora_base), **ENGINE, num_blocks=64, max_loras=2, max_lora_rank=8)
    loras = _requests(lora_adapters)
    kv = llm.engine.kv_cache
    for name in ("a1", "a2", None):
        hits = kv.prefix_cache_hits
        out = llm.generate([PROMPTS[0]], GREEDY, lora_request=loras[name])[0]
        assert list(out.outputs[0].token_ids) == peft_reference[name][0]
        assert kv.prefix_cache_hits == hits, f"{name} hit another adapter's blocks"
    out = llm.generate([PROMPTS[0]], GREEDY, lora_request=loras["a1"])[0]
    assert list(out.outputs[0].token_ids) == peft_reference["a1"][0]
    assert kv.prefix_cache_hits > hits  # a1's own first block


def test_structured_output_with_adapter(lora_base: Path, lora_adapters: dict[str, Path]) -> None:
    from kvflow.sampling_params import StructuredOutputsParams

    llm = LLM(str(lora_base), **ENGINE, num_blocks=64, max_loras=1, max_lora_rank=8)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    lora = _requests(lora_adapters)["a1"]
    outputs = llm.generate([PROMPTS[0], PROMPTS[1]], params, lora_request=lora)
    assert all(o.outputs[0].text in ("yes", "no") for o in outputs)


def test_slots_are_preallocated_and_reused(
    lora_base: Path, lora_adapters: dict[str, Path], peft_reference: Reference
) -> None:
    """One slot, two adapters in turn (and a host cache of one): each load copies into
    the same memory, and the answers stay PEFT's."""
    llm = LLM(str(lora_base), **ENGINE, num_blocks=64, max_loras=1, max_lora_rank=8)
    manager = llm.engine.runner.lora.manager  # type: ignore[union-attr]
    slots = {id(t.layer.lora): t.layer.lora for t in manager.targets.values()}.values()
    pointers = [(s.a.data_ptr(), s.b.data_ptr()) for s in slots]  # type: ignore[union-attr]
    assert manager.slot_bytes > 0
    loras = _requests(lora_adapters)
    for name in ("a1", "a2", "a1"):
        out = llm.generate([PROMPTS[1]], GREEDY, lora_request=loras[name])[0]
        assert list(out.outputs[0].token_ids) == peft_reference[name][1]
    assert [(s.a.data_ptr(), s.b.data_ptr()) for s in slots] == pointers  # type: ignore[union-attr]


def test_unusable_adapters_fail_at_generate(lora_base: Path, tmp_path: Path) -> None:
    from kvflow.errors import LoRAAdapterError

    llm = LLM(str(lora_base), **ENGINE, num_blocks=64)
    with pytest.raises(LoRAAdapterError, match=r"adapter_config\.json is missing"):
        llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("x", 1, str(tmp_path)))
    base_only = LLM(str(lora_base), dtype="float32", device="cpu", num_blocks=64)
    with pytest.raises(LoRAAdapterError, match="enable_lora"):
        base_only.generate(PROMPTS, GREEDY, lora_request=LoRARequest("x", 1, str(tmp_path)))
    assert len(llm.generate(PROMPTS, GREEDY)) == 2  # the engine still serves
