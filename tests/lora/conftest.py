"""Shared fixtures of the LoRA tests: a tiny Llama base, two PEFT adapters of it with
random non-zero A and B (different ranks, targets and scalings), and PEFT's own greedy
tokens for a few prompts under each."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from lora_adapters import ALL_TARGETS, MAX_TOKENS, PROMPTS, make_adapter, peft_greedy

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))  # serve_harness


@pytest.fixture(scope="session")
def lora_base(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def lora_adapters(lora_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`a1`: rank 8, every target, lora_alpha scaling; `a2`: rank 4, rsLoRA, three."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": make_adapter(lora_base, root / "a1", seed=1, rank=8, targets=ALL_TARGETS),
        "a2": make_adapter(
            lora_base,
            root / "a2",
            seed=2,
            rank=4,
            use_rslora=True,
            targets=["q_proj", "v_proj", "down_proj"],
        ),
    }


@pytest.fixture(scope="session")
def peft_reference(
    lora_base: Path, lora_adapters: dict[str, Path]
) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens of PROMPTS: under None (the base), `a1` and `a2`."""
    reference: dict[str | None, list[list[int]]] = {
        None: peft_greedy(lora_base, None, PROMPTS, MAX_TOKENS)
    }
    for name, path in lora_adapters.items():
        reference[name] = peft_greedy(lora_base, path, PROMPTS, MAX_TOKENS)
    return reference
