"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the vision tower of qwen_vision.py
and the Qwen2 decoder with M-RoPE (layers/mrope.py) as the language model.

    patch rows + grid -> vision tower -> one embedding per `<|image_pad|>` placeholder

As in LLaVA (llava.py), the runner's image feature sets the features of a step's
placeholder rows (`set_image_embeddings`) and the forward puts them in place of those
tokens' embeddings. A step whose requests carry M-RoPE positions (their prompts had
images) gets them from the runner's M-RoPE feature (`set_mrope_positions`, [3, T]),
otherwise the forward's 1-D positions are every row's (text: the three rows agree).

Checkpoint names: Qwen's (`model.layers.*`, `visual.*`, `lm_head.*`) and transformers
5's (`model.language_model.*`, `model.visual.*`) both load.
"""

from __future__ import annotations

from typing import Any

import torch

from kvflow.gpu_worker.attention.backend import AttentionBackend
from kvflow.gpu_worker.layers.mrope import MRopeEmbedding
from kvflow.gpu_worker.layers.rotary import rope_parameters
from kvflow.gpu_worker.models.image_embeddings import with_image_embeddings
from kvflow.gpu_worker.models.qwen import Qwen2ForCausalLM
from kvflow.gpu_worker.models.qwen_vision import QwenVisionTower
from kvflow.gpu_worker.models.spec import DEFAULT_ROPE, head_dim_of
from kvflow.gpu_worker.weights import packed_target


def _canonical(name: str) -> str:
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return name.replace("model.language_model.", "model.", 1)


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """The decoder (and LM head) of the text config; the vision tower beside it."""

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        text = config.text_config
        super().__init__(text, backend)
        params = rope_parameters(text)
        if "mrope_section" not in params:
            raise ValueError("a Qwen2.5-VL text config without rope mrope_section")
        self.model.rotary_embs[DEFAULT_ROPE] = MRopeEmbedding(
            head_dim_of(text), params, text.max_position_embeddings
        )
        self.visual = QwenVisionTower(config.vision_config)
        self.image_token_id = int(config.image_token_id)
        self._image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mrope_positions: torch.Tensor | None = None

    def encode_images(self, pixels: torch.Tensor, grid_thw: list[int]) -> torch.Tensor:
        """pixels [N, P, C*tp*p*p] of N images of grid `grid_thw` -> [N, P / m^2, hidden]."""
        return self.visual(pixels, grid_thw)  # type: ignore[no-any-return]

    def set_image_embeddings(
        self, rows: torch.Tensor | None, features: torch.Tensor | None
    ) -> None:
        """The next forward's image features [R, hidden] at its token rows [R] (None: none)."""
        self._image_rows = None if rows is None or features is None else (rows, features)

    def set_mrope_positions(self, positions: torch.Tensor | None) -> None:
        """The next forward's positions [3, T] (None: its 1-D positions)."""
        self._mrope_positions = positions

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        received: Any = None,
        output_rows: torch.Tensor | None = None,
    ) -> Any:
        if self._mrope_positions is not None:
            positions = self._mrope_positions
        embed = self.model.embed_tokens
        received = with_image_embeddings(embed, input_ids, self._image_rows, received)
        return self.model(input_ids, positions, received, output_rows)

    def checkpoint_target(self, name: str) -> tuple[str, Any]:
        """(parameter name, shard) of checkpoint tensor `name` (weights.load_weights)."""
        name = _canonical(name)
        if name.startswith("visual."):
            return name, None
        return packed_target(name, self.packed_modules_mapping)

    def skips_weight(self, name: str) -> bool:
        return super().skips_weight(_canonical(name))  # type: ignore[no-any-return]
