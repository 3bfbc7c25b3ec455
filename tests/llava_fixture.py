"""A tiny random-weight LLaVA directory (CLIP or SigLIP vision tower, Llama text model)
with a processor assembled from the tower's image processor and the embedded model's
tokenizer plus an `<image>` token, as the LLaVA tests build it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

IMAGE_TOKEN = "<image>"


def make_llava_dir(
    path: Path,
    tokenizer_dir: Path,
    image_size: int,
    tower: str = "clip",
    feature_layer: int | list[int] = -2,
    strategy: str = "default",
) -> Path:
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=image_size, patch_size=14,
    )  # fmt: skip
    if tower == "clip":
        vision: object = CLIPVisionConfig(**shape, projection_dim=32)
        image_processor: object = CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        )
    else:  # SigLIP: no class token; a fixed-size resize, mean and std 0.5
        vision = SiglipVisionConfig(**shape, hidden_act="gelu_pytorch_tanh")
        image_processor = SiglipImageProcessor(size={"height": image_size, "width": image_size})
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
    )  # fmt: skip
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=int(tower == "clip"),
    )  # fmt: skip
    processor.save_pretrained(path)
    return path


def random_image(seed: int, width: int, height: int) -> object:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
