"""Bodies of POST /v1/embeddings (OpenAI's shape) and POST /pooling (vLLM's), requests
and responses, as msgspec Structs (the handlers decode them; /openapi.json shows them).

`input` takes OpenAI's four forms: a string, a list of strings, a list of token ids,
or a list of token-id lists; each string or id list is embedded on its own.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvflow.errors import InvalidRequestError
from kvflow.services.frontend.protocol import Text, TokenId, TokenIds

MAX_INPUTS = 2048  # OpenAI's cap on one request's inputs; bounds the fan-out too
EncodingFormat = Literal["float", "base64"]
Inputs = Annotated[list[Text | TokenId | TokenIds], Meta(min_length=1, max_length=MAX_INPUTS)]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Text | Inputs
    model: str | None = None  # None: the one served model
    encoding_format: EncodingFormat = "float"
    dimensions: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None  # Matryoshka models
    user: str | None = None
    # vLLM extras
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None
    add_special_tokens: bool = True
    priority: Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)] = 0

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list, each a text or token ids (never a mix of the forms)."""
        items = self.input
        if isinstance(items, str):
            return [items]
        if all(isinstance(item, int) for item in items):
            return [[int(item) for item in items]]  # type: ignore[arg-type]
        if all(isinstance(item, str) for item in items) or all(
            isinstance(item, list) for item in items
        ):
            return list(items)  # type: ignore[arg-type]
        raise InvalidRequestError(
            "input must be a string, a list of strings, a list of token ids or a list of "
            "token id lists (not a mix)",
            param="input",
        )


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """POST /pooling: the same fields (vLLM's embed task); the response says `data`."""


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # base64: the float32 little-endian bytes
    object: Literal["embedding"] = "embedding"


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


class PoolingData(msgspec.Struct, kw_only=True):
    index: int
    data: list[float] | str
    object: Literal["pooling"] = "pooling"


class PoolingResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage
    object: Literal["list"] = "list"
