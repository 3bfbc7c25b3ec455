"""`kvflow bench vlm-config DIR`: a LLaVA-shaped vision-language model directory of
about 1B parameters without weights, for speed runs with `--load-format dummy` (random
weights of the model's shapes; kvflow and vLLM both read it).

    vision  SigLIP-so400m shapes (hidden 1152, 27 layers, patch 14, 384 px: 729
            features an image, strategy "full", last layer) or CLIP-L/14-336 (--vision clip)
    text    a Llama of Qwen2-0.5B's size class (hidden 1024, 24 layers, 16 / 4 heads)
    files   config.json; the embedded model's tokenizer plus an `<image>` token and its
            chat template; the tower's image processor and a LlavaProcessor, written both
            in one processor_config.json and in the older preprocessor_config.json, so
            that transformers releases before and after the single-file layout read it

`--text-hidden/--text-layers/--vision-hidden/--vision-layers/--image-size` shrink it
(e.g. for a quick check: `--text-hidden 128 --text-layers 2 --vision-hidden 64
--vision-layers 2 --image-size 112`). Head sizes stay at 64 in the language model
(vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, ... only) and near the tower's own.

`kvflow bench vlm` writes one and serves it with kvflow and vLLM (kvflow/bench/vlm.py).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

IMAGE_TOKEN = "<image>"
TEXT_HEAD_DIM = 64
PATCH = 14


@dataclass(frozen=True)
class Tower:
    config: dict[str, Any]  # the full-size vision config
    head_dim: int
    feature_layer: int
    strategy: Literal["default", "full"]  # "full" keeps every feature, "default" drops the CLS one
    extra_tokens: int  # positions an image has beyond its patches (CLIP's CLS)


TOWERS: dict[str, Tower] = {
    "siglip": Tower(
        dict(
            model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
            num_hidden_layers=27, image_size=384, patch_size=PATCH,
            hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
        ),
        72, -1, "full", 0,
    ),
    "clip": Tower(
        dict(
            model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
            num_hidden_layers=24, image_size=336, patch_size=PATCH, hidden_act="quick_gelu",
            projection_dim=768,
        ),
        64, -2, "default", 1,
    ),
}  # fmt: skip
TEXT: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
    max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """None: the full size."""

    text_hidden: int | None = None
    text_layers: int | None = None
    vision_hidden: int | None = None
    vision_layers: int | None = None
    image_size: int | None = None


def text_config(sizes: Sizes) -> dict[str, Any]:
    hidden = sizes.text_hidden or TEXT["hidden_size"]
    if hidden % TEXT_HEAD_DIM:
        raise ValueError(f"--text-hidden must be a multiple of {TEXT_HEAD_DIM}, got {hidden}")
    heads = hidden // TEXT_HEAD_DIM
    scale = hidden / TEXT["hidden_size"]
    return {
        **TEXT,
        "hidden_size": hidden,
        "intermediate_size": round(TEXT["intermediate_size"] * scale),
        "num_hidden_layers": sizes.text_layers or TEXT["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
    }


def vision_config(tower: Tower, sizes: Sizes) -> dict[str, Any]:
    full = tower.config
    hidden = sizes.vision_hidden or full["hidden_size"]
    heads = max(1, hidden // tower.head_dim)
    if hidden % heads:
        raise ValueError(f"--vision-hidden {hidden} does not split into {heads} heads")
    image_size = sizes.image_size or full["image_size"]
    if image_size < PATCH:
        raise ValueError(f"--image-size must be at least a patch ({PATCH}), got {image_size}")
    return {
        **full,
        "hidden_size": hidden,
        "intermediate_size": round(full["intermediate_size"] * hidden / full["hidden_size"]),
        "num_hidden_layers": sizes.vision_layers or full["num_hidden_layers"],
        "num_attention_heads": heads,
        "image_size": image_size,
    }


def image_tokens(tower: Tower, image_size: int) -> int:
    """Placeholder tokens an image expands to (the features the projector hands over);
    the patch grid drops a partial patch (384 px: 27 x 27)."""
    patches = (image_size // PATCH) ** 2
    return patches if tower.strategy == "full" else patches + tower.extra_tokens - 1


def write_vlm_dir(
    path: Path, tokenizer_dir: Path, vision: str = "siglip", sizes: Sizes = Sizes()
) -> int:
    """Write the directory; returns the model's parameter count."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tower = TOWERS[vision]
    vision_cfg = vision_config(tower, sizes)
    config = LlavaConfig(
        vision_config=vision_cfg,
        text_config=LlamaConfig(vocab_size=len(tokenizer), **text_config(sizes)),
        image_token_index=int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)),  # type: ignore[arg-type]
        image_seq_length=image_tokens(tower, vision_cfg["image_size"]),
        vision_feature_layer=tower.feature_layer,
        vision_feature_select_strategy=tower.strategy,
        projector_hidden_act="gelu",
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    _write_processor(path, tokenizer, vision, tower, int(vision_cfg["image_size"]))
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())


def _write_processor(path: Path, tokenizer: Any, vision: str, tower: Tower, size: int) -> None:
    from transformers import CLIPImageProcessor, LlavaProcessor, SiglipImageProcessor

    image_processor: Any
    if vision == "siglip":
        image_processor = SiglipImageProcessor(size={"height": size, "width": size})
    else:
        crop = {"height": size, "width": size}
        image_processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size=crop)
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
        vision_feature_select_strategy=tower.strategy,
        num_additional_image_tokens=tower.extra_tokens, chat_template=tokenizer.chat_template,
    )  # fmt: skip
    processor.save_pretrained(path)
    # Releases before the single-file layout look for the image processor here.
    legacy = json.loads(image_processor.to_json_string())
    (path / "preprocessor_config.json").write_text(json.dumps(legacy, indent=2) + "\n")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", help="directory to write")
    add_size_args(parser)


def add_size_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vision", choices=sorted(TOWERS), default="siglip")
    parser.add_argument("--text-hidden", type=int, default=None, help="default 1024")
    parser.add_argument("--text-layers", type=int, default=None, help="default 24")
    parser.add_argument("--vision-hidden", type=int, default=None, help="default the tower's")
    parser.add_argument("--vision-layers", type=int, default=None, help="default the tower's")
    parser.add_argument(
        "--image-size", type=int, default=None, help="tower input px, default its own"
    )


def sizes_of(args: argparse.Namespace) -> Sizes:
    return Sizes(
        args.text_hidden, args.text_layers, args.vision_hidden, args.vision_layers, args.image_size
    )


def write_from_args(output: Path, args: argparse.Namespace) -> int:
    from kvflow.gpu_worker.model_files import resolve_model_dir

    return write_vlm_dir(output, resolve_model_dir(None), args.vision, sizes_of(args))


def run(args: argparse.Namespace) -> int:
    count = write_from_args(Path(args.output), args)
    print(f"wrote {args.output}: LLaVA ({args.vision} tower), {count / 1e9:.2f}B parameters")
    return 0
