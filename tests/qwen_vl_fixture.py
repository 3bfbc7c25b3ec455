"""A tiny random-weight Qwen2.5-VL directory (window-attention vision tower, Qwen2 text
model with M-RoPE) with the embedded model's tokenizer plus Qwen's vision tokens and a
Qwen2VL `preprocessor_config.json`; and transformers' greedy reference on it (its own
image processor, its own model, placeholders expanded as Qwen's processor does)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 48  # 4 .. 48 merged tokens an image


def make_qwen_vl_dir(path: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
    )  # fmt: skip
    vision = dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
        fullatt_block_indexes=[1], initializer_range=0.2,
    )  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[1], video_token_id=ids[3],
        vision_start_token_id=ids[0], vision_end_token_id=ids[2], tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    return path


@functools.cache
def _hf(path: Path) -> tuple[Any, Any, Any]:
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path)), processor, model.eval()


def hf_expand(path: Path, prompt: str, images: list[Any]) -> tuple[list[int], dict[str, Any]]:
    """(expanded prompt ids, the model's image inputs) as Qwen's processor makes them."""
    tokenizer, processor, model = _hf(path)
    ids: list[int] = tokenizer.encode(prompt)
    if not images:
        return ids, {}
    inputs = processor(images, return_tensors="pt")
    counts = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
    pad = model.config.image_token_id
    ids = [t for token in ids for t in ([token] * next(counts) if token == pad else [token])]
    return ids, dict(inputs)


def hf_greedy(
    path: Path, prompt: str, images: list[Any], max_tokens: int
) -> tuple[list[int], list[int]]:
    """(transformers' expanded prompt ids, its greedy continuation)."""
    _, _, model = _hf(path)
    ids, inputs = hf_expand(path, prompt, images)
    input_ids = torch.tensor([ids])
    types = (input_ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, mm_token_type_ids=types, max_new_tokens=max_tokens,
            do_sample=False, **inputs,
        )  # fmt: skip
    return ids, out[0, len(ids) :].tolist()
