"""POST /v1/embeddings (OpenAI's shape) and POST /pooling (vLLM's) on a pooling server.

Each input runs as one engine request (prefill only: the engine's pooling runner);
its final delta carries the pooled float32 vector, which is cut to `dimensions`
(Matryoshka models only, kvflow/pooling.py) and returned as floats or base64 of the
float32 little-endian bytes (what the `openai` client decodes). Usage counts the input
tokens. A generating server refuses these routes with a 400 (runner_routes.py).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping
from contextlib import aclosing

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from kvflow.model_limits import check_pooling_prompt
from kvflow.pooling import check_dimensions, embedding_vector
from kvflow.sampling_params import SamplingParams, truncate_prompt, validate_sampling_params
from kvflow.services.frontend.embeddings_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
)
from kvflow.services.frontend.ignored_fields import ignored_fields, mark_ignored
from kvflow.services.frontend.protocol import decode_request
from kvflow.services.frontend.request_deadline import request_deadlines
from kvflow.services.frontend.runner_routes import pooling_spec
from kvflow.services.frontend.serving_common import (
    PreparedPrompt,
    RequestFailedError,
    ServingContext,
    json_response,
)
from kvflow.services.frontend.sse import until_disconnect


class ServedEmbedding:
    """One validated /v1/embeddings or /pooling request: its inputs run together."""

    def __init__(self, ctx: ServingContext, request: EmbeddingRequest, headers: Mapping[str, str]):
        self.ctx = ctx
        self.spec = pooling_spec(ctx)
        self.request = request
        self.pooling = isinstance(request, PoolingRequest)
        check_dimensions(self.spec, request.dimensions)
        params = SamplingParams(max_tokens=1, truncate_prompt_tokens=request.truncate_prompt_tokens)
        validate_sampling_params(params)
        self.prompts = [self._prepare(item, params) for item in request.inputs()]
        ctx.check_queue_room(len(self.prompts), 1, None)
        self.id = f"{'pool' if self.pooling else 'embd'}-{uuid.uuid4().hex}"
        self.arrival_time = time.time()
        self.deadlines = request_deadlines(None, headers, stream=False)

    def _prepare(self, item: str | list[int], params: SamplingParams) -> PreparedPrompt:
        ctx = self.ctx
        if isinstance(item, str):
            text: str | None = item
            ids = ctx.encode(item, self.request.add_special_tokens)
        else:
            text, ids = None, list(item)
        ids = truncate_prompt(ids, params, ctx.config.max_model_len)
        check_pooling_prompt(ids, ctx.config.max_model_len, ctx.config.vocab_size)
        return PreparedPrompt(ids, text, params)

    async def respond(self, raw: Request) -> Response:
        return await until_disconnect(raw, self.full())

    async def full(self) -> Response:
        """The response once every input is pooled."""
        pooled: list[bytes] = [b""] * len(self.prompts)
        stream = self.ctx.generate(
            self.id,
            self.prompts,
            priority=self.request.priority,
            cache_salt=None,
            arrival_time=self.arrival_time,
            deadline=self.deadlines.whole,
        )
        async with aclosing(stream) as deltas:
            async for index, delta in deltas:
                if delta.finish_reason is not None:
                    pooled[index] = delta.pooled
        if not all(pooled):
            raise RequestFailedError("the engine finished an input without its vector")
        vectors = [embedding_vector(p, self.spec, self.request.dimensions) for p in pooled]
        return json_response(self._response([self._encode(v) for v in vectors]))

    def _encode(self, vector: np.ndarray) -> list[float] | str:
        if self.request.encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return vector.tolist()  # type: ignore[no-any-return]

    def _response(self, values: list[list[float] | str]) -> EmbeddingResponse | PoolingResponse:
        num_tokens = sum(len(p.token_ids) for p in self.prompts)
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        created, model = int(self.arrival_time), self.ctx.config.served_model_name
        if self.pooling:
            data = [PoolingData(index=i, data=v) for i, v in enumerate(values)]
            return PoolingResponse(id=self.id, created=created, model=model, data=data, usage=usage)
        embeddings = [EmbeddingData(index=i, embedding=v) for i, v in enumerate(values)]
        return EmbeddingResponse(
            id=self.id, created=created, model=model, data=embeddings, usage=usage
        )


def prepare_embedding(
    ctx: ServingContext, body: bytes, headers: Mapping[str, str]
) -> tuple[ServedEmbedding, bool]:
    """A validated /v1/embeddings body, ready to run (never streamed); raises what
    becomes the error response. `kvflow run-batch` calls it too."""
    return _prepare_request(ctx, body, headers, EmbeddingRequest), False


def _prepare_request(
    ctx: ServingContext,
    body: bytes,
    headers: Mapping[str, str],
    request_type: type[EmbeddingRequest],
) -> ServedEmbedding:
    pooling_spec(ctx)  # a generating server says so before judging the body
    request = decode_request(body, request_type)
    ctx.check_model(request.model)
    served = ServedEmbedding(ctx, request, headers)
    ctx.check_engine()
    return served


async def create_embedding(ctx: ServingContext, raw: Request, body: bytes) -> Response:
    served = _prepare_request(ctx, body, raw.headers, EmbeddingRequest)
    ignored = ignored_fields(body, EmbeddingRequest)
    return mark_ignored(await served.respond(raw), ignored)


async def create_pooling(ctx: ServingContext, raw: Request, body: bytes) -> Response:
    served = _prepare_request(ctx, body, raw.headers, PoolingRequest)
    ignored = ignored_fields(body, PoolingRequest)
    return mark_ignored(await served.respond(raw), ignored)
