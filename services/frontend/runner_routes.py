"""Which routes a server answers by its runner: a generating server refuses the
pooling routes, a pooling server the generation routes, each with a 400 that says
which server the client reached (`--runner`, config.py)."""

from __future__ import annotations

from kvflow.errors import InvalidRequestError
from kvflow.pooling import PoolingSpec
from kvflow.services.frontend.serving_common import ServingContext


def check_generating(ctx: ServingContext) -> None:
    """400 for a generation route on a pooling server."""
    if ctx.config.pooling is not None:
        raise InvalidRequestError(
            "this server runs the pooling runner (--runner pooling): it serves "
            "/v1/embeddings and /pooling, not generation",
            param="model",
        )


def pooling_spec(ctx: ServingContext) -> PoolingSpec:
    """The server's pooler; 400 on a generating server."""
    if ctx.config.pooling is None:
        raise InvalidRequestError(
            "this server generates text: embeddings need a server started with --runner pooling",
            param="model",
        )
    return ctx.config.pooling
