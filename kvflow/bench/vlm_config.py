"""`kvflow bench vlm-config DIR`: a LLaVA-shaped vision-language model directory of
about 1B parameters without weights, for speed runs with `--load-format dummy` (random
weights of the model's shapes; kvflow and vLLM both read it).

    vision  SigLIP-so400m shapes (hidden 1152, 27 layers, patch 14, 384 px: 729
            features an image, strategy "full", last layer) or CLIP-L/14-336 (--vision clip)
    text    a Llama of Qwen2-0.5B's size class (hidden 1024, 24 layers, 16 / 4 heads)
    files   config.json; the embedded model's tokenizer plus an `<image>` token and its
            chat template; the tower's image processor and a LlavaProcessor

The whole speed comparison (docs/benchmarks.md, "Vision-language serving") starts
both servers on this directory and load-tests each with `kvflow bench serve
--random-image-size 448x448`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
# name -> (vision config kwargs, feature layer, select strategy, extra tokens an image)
TOWERS: dict[str, tuple[dict[str, Any], int, Any, int]] = {
    "siglip": (
        dict(
            model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
            num_hidden_layers=27, num_attention_heads=16, image_size=384, patch_size=14,
            hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
        ),
        -1, "full", 0,
    ),
    "clip": (
        dict(
            model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
            num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
            hidden_act="quick_gelu", projection_dim=768,
        ),
        -2, "default", 1,
    ),
}  # fmt: skip
TEXT: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
    tie_word_embeddings=False, rms_norm_eps=1e-6,
)  # fmt: skip


def write_vlm_dir(path: Path, tokenizer_dir: Path, vision: str = "siglip") -> int:
    """Write the directory; returns the model's parameter count."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tower, layer, strategy, extra = TOWERS[vision]
    size = int(tower["image_size"])
    config = LlavaConfig(
        vision_config=dict(tower), text_config=LlamaConfig(vocab_size=len(tokenizer), **TEXT),
        image_token_index=int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)),  # type: ignore[arg-type]
        vision_feature_layer=layer, vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
    )  # fmt: skip
    config.architectures = ["LlavaForConditionalGeneration"]
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    image_processor: Any
    if vision == "siglip":
        image_processor = SiglipImageProcessor(size={"height": size, "width": size})
    else:
        crop = {"height": size, "width": size}
        image_processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size=crop)
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=extra,
        chat_template=tokenizer.chat_template,
    )  # fmt: skip
    processor.save_pretrained(path)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", help="directory to write")
    parser.add_argument("--vision", choices=sorted(TOWERS), default="siglip")


def run(args: argparse.Namespace) -> int:
    from kvflow.gpu_worker.model_files import resolve_model_dir

    count = write_vlm_dir(Path(args.output), resolve_model_dir(None), args.vision)
    print(f"wrote {args.output}: LLaVA ({args.vision} tower), {count / 1e9:.2f}B parameters")
    return 0
