"""POST /tokenize, POST /detokenize and GET /v1/models (vLLM's shapes)."""

from __future__ import annotations

import time

from starlette.responses import Response

from kvflow.errors import InvalidRequestError
from kvflow.services.frontend.protocol import DetokenizeRequest, TokenizeRequest, decode_request
from kvflow.services.frontend.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from kvflow.services.frontend.serving_common import ServingContext, json_response


def tokenize(ctx: ServingContext, body: bytes) -> Response:
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""
    request = decode_request(body, TokenizeRequest)
    ctx.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequestError("give exactly one of 'prompt' and 'messages'", param="prompt")
    if request.messages is not None:
        conversation = [message.to_dict() for message in request.messages]
        tokens = ctx.render_chat(conversation, request.add_generation_prompt)
    else:
        assert request.prompt is not None
        tokens = ctx.encode(request.prompt, request.add_special_tokens)
    response = TokenizeResponse(
        count=len(tokens), max_model_len=ctx.config.max_model_len, tokens=tokens
    )
    return json_response(response)


def detokenize(ctx: ServingContext, body: bytes) -> Response:
    request = decode_request(body, DetokenizeRequest)
    ctx.check_model(request.model)
    vocab_size = ctx.config.vocab_size
    bad = next((t for t in request.tokens if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is out of vocabulary", param="tokens")
    text = ctx.tokenizer.decode(request.tokens, skip_special_tokens=False)
    return json_response(DetokenizeResponse(prompt=str(text)))


def list_models(ctx: ServingContext, created: int | None = None) -> Response:
    config = ctx.config
    created = int(time.time()) if created is None else created
    card = ModelCard(
        id=config.served_model_name,
        created=created,
        root=config.model_root or config.served_model_name,
        max_model_len=config.max_model_len,
    )
    adapters = [
        ModelCard(
            id=name,
            created=created,
            root=adapter.lora_path,
            max_model_len=config.max_model_len,
            parent=config.served_model_name,
        )
        for name, adapter in ctx.lora.adapters.items()
    ]
    return json_response(ModelList(data=[card, *adapters]))
