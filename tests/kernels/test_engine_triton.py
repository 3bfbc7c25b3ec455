"""The engine gives the same greedy tokens with the Triton attention backend as with torch,
on a float and on a quantized KV cache, for every model family kvflow supports: their
attention layers hand the backend different layouts (Llama's K is a view of the fused qkv
output, Qwen3's q/k norm makes it contiguous; V is always a view). The embedded model (a
Llama) takes ~6 minutes interpreted: tests/gpu/test_gpu_parity.py runs it on CUDA."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from llava_fixture import make_llava_dir, random_image
from qwen_vl_fixture import IMAGE as QWEN_IMAGE
from qwen_vl_fixture import make_qwen_vl_dir

from kvflow import LLM, SamplingParams
from kvflow.config import CacheConfig
from kvflow.gpu_worker.models.registry import MODEL_CLASSES

# Every supported text architecture by its tests/conftest.py tiny config name ("llama",
# ...); the vision-language ones have their own test below.
FAMILIES = [
    name.removesuffix("ForCausalLM").lower()
    for name in sorted(MODEL_CLASSES)
    if name.endswith("ForCausalLM")
]
VISION = [name for name in sorted(MODEL_CLASSES) if not name.endswith("ForCausalLM")]


@pytest.mark.parametrize("arch", FAMILIES)
def test_triton_backend_matches_torch_backend_end_to_end(tiny_model_dir: Any, arch: str) -> None:
    path = str(tiny_model_dir(arch))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(100, 137))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # Small blocks and budget: chunked prefill on a cached prefix plus mixed batches.
    # num_blocks: on a GPU each LLM would otherwise size its cache from free memory.
    options = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, num_blocks=256)
    torch_out = LLM(path, attention_backend="torch", **options).generate(prompts, params)
    triton_llm = LLM(path, attention_backend="triton", **options)
    triton_out = triton_llm.generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
    assert type(triton_llm.engine.runner.model.attention_layers()[0].backend).__name__ == (
        "TritonAttentionBackend"
    )


def _vision_case(arch: str, path: Path, embedded_model_dir: Path) -> tuple[str, str]:
    """(model directory, a prompt with one image) of a vision-language architecture."""
    if arch == "LlavaForConditionalGeneration":
        return str(make_llava_dir(path, embedded_model_dir, 28)), "USER: <image>\nWhat? ASSISTANT:"
    assert arch == "Qwen2_5_VLForConditionalGeneration"  # a new one needs its case here
    return str(make_qwen_vl_dir(path, embedded_model_dir)), f"User: {QWEN_IMAGE}\nWhat? Assistant:"


@pytest.mark.parametrize("arch", VISION)
def test_vision_language_models_match_too(
    tmp_path: Path, embedded_model_dir: Path, arch: str
) -> None:
    path, text = _vision_case(arch, tmp_path, embedded_model_dir)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": image}}
        for image in (random_image(1, 40, 30), random_image(2, 64, 64))
    ]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    options = dict(dtype="float32", block_size=4, max_num_batched_tokens=8, num_blocks=256)
    torch_out = LLM(path, attention_backend="torch", **options).generate(prompts, params)
    triton_out = LLM(path, attention_backend="triton", **options).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in triton_out] == [
        o.outputs[0].token_ids for o in torch_out
    ]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_triton_backend_serves_a_quantized_cache_like_torch(
    tiny_model_dir: Any, kv_cache_dtype: str
) -> None:
    # Both backends quantize what they store, read decodes and chunks over a cached prefix
    # back dequantized, and let fresh prefills attend their own K/V: the same tokens.
    if "kv_cache_dtype" not in {f.name for f in dataclasses.fields(CacheConfig)}:
        pytest.skip("this tree has no --kv-cache-dtype yet")
    path = str(tiny_model_dir("qwen3"))
    prompts = [[1, 2, 3, 4, 5, 6, 7], list(range(100, 137))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    options = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, num_blocks=256)
    options["kv_cache_dtype"] = kv_cache_dtype
    torch_out = LLM(path, attention_backend="torch", **options).generate(prompts, params)
    triton_out = LLM(path, attention_backend="triton", **options).generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
