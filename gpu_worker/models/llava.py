"""LLaVA (`LlavaForConditionalGeneration`, as in LLaVA-1.5): a CLIP or SigLIP vision
tower, a projector (linear-GELU-linear) and kvflow's dense decoder as the language model.

    image pixels -> vision tower -> hidden_states[vision_feature_layer] (drop the first
    position: strategy "default", CLIP's class token) -> projector -> one embedding per
    placeholder token

The language model runs the paged decoder of llama.py unchanged. For a step whose
tokens include image placeholders, the runner's image feature (image_feature.py) sets
the features of those rows (`set_image_embeddings`); the forward then embeds the
tokens, puts the image features at those rows and runs the decoder from there.

Checkpoint names: both transformers layouts load (module docstring of `_canonical`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvflow.gpu_worker.attention.backend import AttentionBackend
from kvflow.gpu_worker.models.clip_vision import ClipVisionTower, activation
from kvflow.gpu_worker.models.image_embeddings import with_image_embeddings
from kvflow.gpu_worker.models.llama import LlamaForCausalLM
from kvflow.gpu_worker.models.siglip_vision import SiglipVisionTower
from kvflow.gpu_worker.weights import packed_target


class LlavaProjector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        num_layers = 1 if isinstance(layers, int) else len(layers)
        vision, text = config.vision_config.hidden_size, config.text_config.hidden_size
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(vision * num_layers, text, bias=bias)
        self.act = activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(text, text, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))  # type: ignore[no-any-return]


VisionTower = ClipVisionTower | SiglipVisionTower
VISION_TOWERS: dict[str, type[VisionTower]] = {
    "clip_vision_model": ClipVisionTower,
    "siglip_vision_model": SiglipVisionTower,
}


class LlavaParts(nn.Module):
    """`model.`: the language model, the vision tower and the projector."""

    def __init__(self, language_model: nn.Module, config: Any) -> None:
        super().__init__()
        tower = VISION_TOWERS.get(config.vision_config.model_type)
        if tower is None:
            raise ValueError(
                f"LLaVA vision tower {config.vision_config.model_type!r}: "
                f"supported are {sorted(VISION_TOWERS)}"
            )
        self.language_model = language_model
        self.vision_tower: VisionTower = tower(config.vision_config)
        self.multi_modal_projector = LlavaProjector(config)


def _canonical(name: str) -> str:
    """A checkpoint name in this model's layout. transformers 5 saves the older layout
    (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`); llava-hf
    checkpoints nest the tower once more (`vision_tower.vision_model.*`)."""
    name = name.removeprefix("model.")
    name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("lm_head."):
        return name
    return "model." + name.replace("language_model.model.", "language_model.", 1)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The decoder (and LM head) of the text config; the vision parts beside it."""

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__(config.text_config, backend)  # self.model: the decoder, for now
        self.llava_config = config
        self.image_token_id = int(config.image_token_index)
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.drop_class_token = config.vision_feature_select_strategy == "default"
        decoder = self._modules["model"]  # the LlamaModel super() built
        assert decoder is not None
        self.model = LlavaParts(decoder, config)  # type: ignore[assignment]
        self._image_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def parts(self) -> LlavaParts:
        parts = self._modules["model"]
        assert isinstance(parts, LlavaParts)
        return parts

    @property
    def decoder(self) -> Any:
        return self.parts.language_model

    def kv_layer_windows(self) -> tuple[int, tuple[int | None, ...]]:
        """The language model's (first layer, windows): the KV cache groups' plan."""
        return self.decoder.start, self.spec.sliding_windows

    def encode_images(self, pixels: torch.Tensor, grid_thw: list[int]) -> torch.Tensor:
        """pixels [N, 3, S, S] -> features [N, placeholders per image, text hidden]
        (`grid_thw` is empty: LLaVA's pixels carry their shape)."""
        parts = self.parts
        states = parts.vision_tower.hidden_states(pixels, self.feature_layers)
        if self.drop_class_token:  # (a SigLIP tower has none: HF drops its first patch)
            states = [s[:, 1:] for s in states]
        features: torch.Tensor = parts.multi_modal_projector(torch.cat(states, dim=-1))
        return features

    def set_image_embeddings(
        self, rows: torch.Tensor | None, features: torch.Tensor | None
    ) -> None:
        """The next forward's image features [R, hidden] at its token rows [R] (None: none)."""
        self._image_rows = None if rows is None or features is None else (rows, features)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        received: Any = None,
        output_rows: torch.Tensor | None = None,
    ) -> Any:
        embed = self.decoder.embed_tokens
        received = with_image_embeddings(embed, input_ids, self._image_rows, received)
        return self.decoder(input_ids, positions, received, output_rows)

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        """(parameter name, shard) of checkpoint tensor `name` (weights.load_weights)."""
        name = _canonical(name)
        if name.startswith("model.language_model."):
            return packed_target(name, self.packed_modules_mapping)
        return name, None

    def skips_weight(self, name: str) -> bool:
        name = _canonical(name)
        if name.startswith("model.vision_tower.head."):  # SigLIP's pooling head: unread
            return True
        if name.startswith("lm_head."):  # tied to the embedding, or another stage's
            return self.lm_head is None or bool(getattr(self.config, "tie_word_embeddings", 0))
        prefix = "model.language_model."
        return name.startswith(prefix) and not self.decoder.holds_weight(name[len(prefix) :])
