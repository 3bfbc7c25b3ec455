"""`--quantization`: every linear layer on quantized weights and int8 activation digits.

Accuracy against the float model, teacher-forced over a fixed set of texts (the chat
answer, prose, code). The thresholds, from docs/quantization.md's measurement with a
margin for summation order (the VNNI and the portable build differ by ~1e-6):
- gguf reads the very weights the float model has (the GGUF's Q4_1/Q8_0 blocks): its
  only error is the activations' ~16 bits, measured max |logit error| 0.017 over 143
  positions and every greedy choice equal; allowed: 0.1 and all equal.
- q8_0 rounds those weights again to 8 bits per block: measured RMS 0.30 (logits'
  own RMS ~7), max 1.8, 138 / 143 greedy choices equal; allowed: RMS 0.6, 90% equal,
  and the chat's answer still right.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvflow import LLM
from kvflow.errors import ConfigError
from kvflow.gpu_worker.model_files import resolve_model_dir
from kvflow.gpu_worker.model_loader import load_model
from kvflow.gpu_worker.quantization import quantize_model
from kvflow.kernels.cpu import int8_linear
from kvflow.sampling_params import SamplingParams

pytestmark = pytest.mark.native(int8_linear.library() is not None)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "The history of Paris spans more than two thousand years, from a Gallic settlement "
    "to a modern capital, and its bridges, markets and schools grew with it.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to make glucose and oxygen. It takes place in the chloroplasts.",
]


@pytest.fixture(scope="module")
def embedded() -> Path:
    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def inputs(embedded: Path) -> tuple[list[list[int]], int]:
    """(token ids per text, where the chat's answer starts in the first)."""
    tokenizer = AutoTokenizer.from_pretrained(str(embedded), local_files_only=True)
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat = tokenizer(prompt + "The capital of France is Paris.<|im_end|>")["input_ids"]
    answer_start = len(tokenizer(prompt)["input_ids"])
    return [chat] + [tokenizer(text)["input_ids"] for text in TEXTS], answer_start


def _logits(embedded: Path, ids: list[list[int]], method: str, prefill_logits) -> torch.Tensor:
    model = load_model(embedded, torch.float32, torch.device("cpu"), "torch", method)
    return torch.cat([prefill_logits(model, tokens) for tokens in ids])


@pytest.fixture(scope="module")
def float_logits(embedded, inputs, prefill_logits) -> torch.Tensor:
    return _logits(embedded, inputs[0], "none", prefill_logits)


@pytest.mark.embedded
@pytest.mark.slow
def test_gguf_is_the_float_model_up_to_activation_rounding(
    embedded, inputs, float_logits, prefill_logits
) -> None:
    logits = _logits(embedded, inputs[0], "gguf", prefill_logits)
    assert (logits - float_logits).abs().max() < 0.1
    assert torch.equal(logits.argmax(-1), float_logits.argmax(-1))


@pytest.mark.embedded
@pytest.mark.slow
def test_q8_0_stays_close_to_the_float_model(
    embedded, inputs, float_logits, prefill_logits
) -> None:
    ids, answer_start = inputs
    logits = _logits(embedded, ids, "q8_0", prefill_logits)
    assert (logits - float_logits).pow(2).mean().sqrt() < 0.6
    agree = (logits.argmax(-1) == float_logits.argmax(-1)).float().mean()
    assert agree >= 0.9
    chat = logits[: len(ids[0])]
    assert chat[answer_start - 1 : -1].argmax(-1).tolist() == ids[0][answer_start:]


def test_every_linear_layer_and_the_lm_head_get_quantized_weights(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir("qwen2"), torch.float32, torch.device("cpu"), "torch", "q8_0")
    quantized = [m for m in model.modules() if getattr(m, "quant", None) is not None]
    assert len(quantized) == 2 * 4 + 1  # qkv, o, gate_up, down; LM head
    assert model.lm_head.quant is not None
    assert all(m.packed_weight is None for m in quantized)  # q8_0 never reads float weights
    assert model.model.layers[0].self_attn.qkv_proj.quant.bits == 8


def test_gguf_needs_a_gguf_checkpoint(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"), "torch")
    with pytest.raises(ConfigError, match="q8_0"):
        quantize_model(model, "gguf")


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="CPU only"):
        LLM(device="cuda", quantization="q8_0")
    with pytest.raises(ConfigError, match="float32"):
        LLM(device="cpu", dtype="bfloat16", quantization="gguf")
    with pytest.raises(ConfigError, match="quantization must be"):
        LLM(device="cpu", quantization="q4_k")


@pytest.mark.slow
def test_offline_generation_end_to_end(tiny_model_dir) -> None:
    """Tiny Qwen2 (qkv bias) in q8_0 through the engine: greedy tokens of a batch equal
    those of each prompt alone (the kernel's result does not depend on the batch), and
    the auto dtype is float32."""
    llm = LLM(model=str(tiny_model_dir("qwen2")), quantization="q8_0", num_threads=1)
    assert llm.engine.config.model.dtype == "float32"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "1 2 3 4"]
    together = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    alone = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    assert together == alone
    assert all(len(tokens) == 12 for tokens in together)


@pytest.mark.embedded
@pytest.mark.slow
def test_gguf_decode_steps_follow_the_float_model(monkeypatch) -> None:
    """Single-stream decode under gguf (one row per step: the VNNI block kernel where the
    CPU has it, else the int8 kernel) against the float model's exact block route: the
    same greedy tokens, each token's logprob within 0.05 (the bound of the teacher-forced
    test above: measured ~0.01 on the logits)."""
    from kvflow.kernels.cpu import block_vnni
    from kvflow.kernels.cpu import linear as linear_module

    calls: list[int] = []
    original = block_vnni.block_vnni_linear

    def counting(x, blocks, bias=None):
        calls.append(x.shape[0])
        return original(x, blocks, bias)

    monkeypatch.setattr(block_vnni, "block_vnni_linear", counting)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    outputs = {}
    for method in ("none", "gguf"):
        llm = LLM(dtype="float32", quantization=method, num_threads=1)
        outputs[method] = llm.chat(CHAT, params)[0].outputs[0]
        llm.close()
    exact, quantized = outputs["none"], outputs["gguf"]
    assert quantized.token_ids == exact.token_ids
    assert exact.logprobs is not None and quantized.logprobs is not None
    for token, a, b in zip(exact.token_ids, exact.logprobs, quantized.logprobs, strict=True):
        assert abs(a[token].logprob - b[token].logprob) < 0.05
    if block_vnni.available() and linear_module.GGUF_VNNI:
        assert calls and set(calls) == {1}  # the decode steps, not the prefill
