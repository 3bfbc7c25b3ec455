"""The embedded SmolLM2-135M-Instruct GGUF, converted to an HF directory and loaded.

The conversion runs once per machine into the default cache dir (the session fixture),
so only the first run of this file pays for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvflow.gpu_worker.model_files import resolve_model_dir
from kvflow.gpu_worker.model_loader import load_model

pytestmark = pytest.mark.embedded

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def tokenizer(embedded_dir: Path):
    return AutoTokenizer.from_pretrained(str(embedded_dir), local_files_only=True)


def test_config_reflects_gguf_metadata(embedded_dir: Path) -> None:
    config = json.loads((embedded_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "eos_token_id": 2,
    }
    assert {key: config[key] for key in expected} == expected
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    generation = json.loads((embedded_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_tokenizer_round_trips(tokenizer) -> None:
    assert tokenizer("Hello world<|im_end|>")["input_ids"] == [19556, 905, 2]
    assert tokenizer.eos_token == "<|im_end|>"
    text = "Grüße, 東京! naïve café — 3.14 ✓"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_logits_match_transformers_on_converted_dir(embedded_dir, tokenizer, prefill_logits):
    ids = tokenizer("The quick brown fox jumps over the")["input_ids"]
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(embedded_dir), dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
    model = load_model(embedded_dir, torch.float32, torch.device("cpu"), "torch")
    torch.testing.assert_close(prefill_logits(model, ids), expected, atol=1e-4, rtol=1e-4)


def test_bf16_greedy_chat_answer_is_right(embedded_dir, tokenizer, prefill_logits) -> None:
    """Independent of transformers: a wrong Q/K un-permutation or tensor mapping would
    not answer this. Teacher-forced in one prefill: greedy decoding yields `answer`
    exactly when each answer token is the argmax after the tokens before it."""
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if not isinstance(prompt, list) else prompt
    answer = tokenizer("The capital of France is Paris.<|im_end|>")["input_ids"]
    model = load_model(embedded_dir, torch.bfloat16, torch.device("cpu"), "torch")
    logits = prefill_logits(model, prompt + answer)
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert predicted == answer
