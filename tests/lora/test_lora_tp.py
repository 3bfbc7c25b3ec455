"""LoRA with tensor parallelism: two worker processes (gloo), A and B sharded the way
their base projection is (column-parallel: B's rows; row-parallel: A's columns), give
PEFT's greedy tokens for base and adapter requests mixed in one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_adapters import MAX_TOKENS, PROMPTS

from kvflow import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow


def test_tp2_mixed_batch_equals_peft(
    lora_base: Path,
    lora_adapters: dict[str, Path],
    peft_reference: dict[str | None, list[list[int]]],
) -> None:
    llm = LLM(
        str(lora_base), dtype="float32", device="cpu", num_threads=1, num_blocks=64,
        tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    try:
        a1 = LoRARequest("a1", 1, str(lora_adapters["a1"]))
        a2 = LoRARequest("a2", 2, str(lora_adapters["a2"]))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(
            [*PROMPTS, *PROMPTS, *PROMPTS], params, lora_request=[a1, a1, None, None, a2, a2]
        )
        got = [list(o.outputs[0].token_ids) for o in outputs]
        assert got == peft_reference["a1"] + peft_reference[None] + peft_reference["a2"]
    finally:
        llm.close()
