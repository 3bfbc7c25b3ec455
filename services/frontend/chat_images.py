"""A chat request's images: from its image_url parts to the engine's pixel tensors.

The parts' URLs are loaded as kvflow/media.py allows (data: URLs always; http(s) and
local files only where the server's flags say), each shown to the chat template as the
model's image token where the part was, and, once the template's text is tokenized,
expanded with the model's own processor (kvflow/image_inputs.py). A text-only model
refuses image parts with a 400.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from kvflow.errors import InvalidRequestError
from kvflow.image_inputs import ExpandedPrompt, Prompter, make_image_prompter
from kvflow.media import MediaOptions, load_image
from kvflow.sampling_params import SamplingParams
from kvflow.services.frontend.protocol import ChatCompletionRequest
from kvflow.services.frontend.serving_common import PreparedPrompt, ServingContext

TEXT_ONLY = "this model takes text only: image_url parts need a vision model"


class ChatImages:
    def __init__(self, options: MediaOptions, vision_model_dir: str | None) -> None:
        self.options = options
        self.prompter: Prompter | None = None
        if vision_model_dir is not None:
            self.prompter = make_image_prompter(Path(vision_model_dir), options.limits)

    def conversation(
        self, request: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]], list[Any]]:
        """(the messages for the chat template, the images in their order)."""
        urls = request.image_urls()
        if not urls:
            return request.conversation(), []
        if self.prompter is None:
            raise InvalidRequestError(TEXT_ONLY, param="messages")
        limit = self.options.limits.max_images
        if len(urls) > limit:  # before any image is decoded
            raise InvalidRequestError(
                f"{len(urls)} images in one request; the limit is {limit} (--limit-mm-per-prompt)",
                param="messages",
            )
        images = [load_image(url, self.options) for url in urls]
        return request.conversation(self.prompter.image_token), images

    def expand(self, token_ids: list[int], images: list[Any]) -> ExpandedPrompt:
        if not images:
            return ExpandedPrompt(token_ids, [], None)
        assert self.prompter is not None  # conversation() refused images otherwise
        return self.prompter.expand(token_ids, images)


@functools.cache
def chat_images(options: MediaOptions, vision_model_dir: str | None) -> ChatImages:
    """One per configuration (the model's processor loads once, on first use)."""
    return ChatImages(options, vision_model_dir)


def prepare_chat_prompt(
    ctx: ServingContext, token_ids: list[int], images: list[Any], params: SamplingParams
) -> PreparedPrompt:
    """ctx.prepare_ids for a rendered chat whose image tokens the images expand."""
    token_ids, inputs, mrope = chat_images(ctx.config.media, ctx.config.vision_model_dir).expand(
        token_ids, images
    )
    prompt = ctx.prepare_ids(token_ids, params, None)
    if inputs and len(prompt.token_ids) != len(token_ids):
        raise InvalidRequestError("truncate_prompt_tokens cannot cut a prompt with images")
    return dataclasses.replace(prompt, images=inputs, mrope=mrope)
