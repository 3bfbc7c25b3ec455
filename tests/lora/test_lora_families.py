"""Every model family takes LoRA: PEFT's greedy tokens under an adapter on each family's
tiny config (the dense ones share Llama's decoder; Phi-3 checkpoints fuse qkv and
gate_up, so PEFT targets the fused names; a mixture-of-experts model adapts its
attention, and an expert target is refused)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from lora_adapters import make_adapter, peft_greedy

from kvflow import LLM, LoRARequest, SamplingParams
from kvflow.errors import LoRAAdapterError

PROMPTS = [[5, 17, 300, 42, 9, 11, 600, 7], [100, 200, 300]]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = {
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "qwen2moe": ATTENTION,
    "qwen3moe": ATTENTION,
    "mixtral": ATTENTION,
}
FAST = ["qwen2", "phi3", "qwen2moe"]
SLOW = [
    "mistral",
    "qwen3",
    "gemma2",
    "gemma3",
    "olmo2",
    "granite",
    "smollm3",
    "qwen3moe",
    "mixtral",
]


@pytest.mark.parametrize("arch", [*FAST, *(pytest.param(a, marks=pytest.mark.slow) for a in SLOW)])
def test_family_with_adapter_equals_peft(
    arch: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_model_dir(arch)
    targets = TARGETS.get(arch, [*ATTENTION, "gate_proj", "up_proj", "down_proj"])
    adapter = make_adapter(base, tmp_path / "adapter", seed=3, rank=4, targets=targets)
    want = peft_greedy(base, adapter, PROMPTS, 4)
    llm = LLM(
        str(base), dtype="float32", device="cpu", num_threads=1, num_blocks=32,
        enable_lora=True, max_lora_rank=4,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    lora = LoRARequest("adapter", 1, str(adapter))
    outputs = llm.generate(PROMPTS, params, lora_request=[lora, lora])
    assert [list(o.outputs[0].token_ids) for o in outputs] == want


def test_expert_targets_are_refused(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    base = tiny_model_dir("qwen2moe")
    adapter = make_adapter(base, tmp_path / "experts", seed=4, rank=4, targets=["gate_proj"])
    llm = LLM(str(base), dtype="float32", device="cpu", num_blocks=32, enable_lora=True)
    with pytest.raises(LoRAAdapterError, match="experts of a mixture-of-experts model"):
        llm.generate(PROMPTS, lora_request=LoRARequest("experts", 1, str(adapter)))
