"""OpenAI-shaped error replies and the one mapping from exceptions to HTTP statuses.

Body shape (what the `openai` client parses):
    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

| cause                                             | status | type                  |
|---------------------------------------------------|--------|-----------------------|
| malformed JSON, wrong types, out-of-range values  | 400    | invalid_request_error |
| prompt + max_tokens over the context, logprobs    | 400    | invalid_request_error |
| missing / wrong API key                           | 401    | authentication_error  |
| unknown model, unknown route                      | 404    | not_found_error       |
| body larger than the limit                        | 413    | invalid_request_error |
| body not UTF-8, nested deeper than the limit      | 400    | invalid_request_error |
| the request's own timeout passed (code timeout)   | 408    | timeout_error         |
| max_waiting_requests wait already (queue_full)    | 429    | rate_limit_error      |
| waited past max_queue_delay (queue_timeout)       | 503    | service_unavailable   |
| engine dead before the request started            | 503    | service_unavailable   |
| engine died while the request ran                 | 500    | server_error          |
| anything unexpected (logged with its traceback)   | 500    | server_error          |

429 and 503 for load carry `Retry-After` (seconds): the `openai` client honours it
when it retries. Validation errors are 400, not 422, as OpenAI and vLLM answer them: clients treat
400 as "fix your request", and the `openai` client raises `BadRequestError` for it.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

import msgspec
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from kvflow.errors import (
    EngineDeadError,
    InvalidRequestError,
    KvflowError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
)

logger = logging.getLogger(__name__)


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error reply decided by the HTTP layer itself (auth, size, routing, health)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message, error_type, param, code)
        self.headers = headers or {}  # e.g. Allow (405), WWW-Authenticate (401), Retry-After


class RequestTooLargeError(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"request body is larger than the limit of {limit} bytes",
            code="request_too_large",
        )


_ENCODER = msgspec.json.Encoder()
RETRY_AFTER_S = 1  # a queue drains in about a step or a few: retry soon, not at once
_LOAD_ERROR_TYPES = {429: "rate_limit_error", 503: "service_unavailable"}
# Not a standard status; nginx's name for "the client closed the request".
CLIENT_CLOSED_REQUEST = 499
# msgspec says where a value failed: "... - at `$.messages[0].role`".
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def error_info(exc: BaseException) -> tuple[int, ErrorInfo]:
    """Status and body for any exception; unexpected ones are logged with a traceback."""
    if isinstance(exc, APIError):
        return exc.status, exc.info
    if isinstance(exc, ClientDisconnect):  # left while sending the body: nobody to answer
        return CLIENT_CLOSED_REQUEST, ErrorInfo("the client closed the request", "client_closed")
    if isinstance(exc, msgspec.ValidationError):
        return HTTPStatus.BAD_REQUEST, _validation_info(str(exc))
    if isinstance(exc, msgspec.DecodeError):
        return HTTPStatus.BAD_REQUEST, ErrorInfo(
            f"malformed JSON body: {exc}", "invalid_request_error"
        )
    if isinstance(exc, RequestRejectedError):  # before its base class: not a 400
        error_type = _LOAD_ERROR_TYPES.get(exc.status_code, "service_unavailable")
        return exc.status_code, ErrorInfo(exc.message, error_type, None, exc.code)
    if isinstance(exc, RequestTimeoutError):
        return exc.status_code, ErrorInfo(str(exc), "timeout_error", "timeout", exc.code)
    if isinstance(exc, InvalidRequestError):
        return HTTPStatus.BAD_REQUEST, ErrorInfo(exc.message, "invalid_request_error", exc.param)
    if isinstance(exc, ModelNotFoundError):
        return HTTPStatus.NOT_FOUND, ErrorInfo(
            str(exc), "not_found_error", "model", "model_not_found"
        )
    if isinstance(exc, EngineDeadError):
        return HTTPStatus.SERVICE_UNAVAILABLE, ErrorInfo(
            f"the engine is not available: {exc}", "service_unavailable"
        )
    if isinstance(exc, KvflowError):
        logger.error("request failed: %s", exc)
        return HTTPStatus.INTERNAL_SERVER_ERROR, ErrorInfo(str(exc), "server_error")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return HTTPStatus.INTERNAL_SERVER_ERROR, ErrorInfo("internal server error", "server_error")


def _validation_info(text: str) -> ErrorInfo:
    """msgspec's 'Expected `int`, got `str` - at `$.n`' -> message + param 'n'."""
    param: str | None = None
    match = _PATH.search(text)
    if match is not None:
        param = match.group(1) or None
        text = text[: match.start()]
    missing = _MISSING.search(text)
    if missing is not None:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    message = f"invalid value for '{param}': {text}" if param else text
    return ErrorInfo(message, "invalid_request_error", param)


def error_body(info: ErrorInfo) -> bytes:
    return _ENCODER.encode(ErrorResponse(info))


def error_response(exc: BaseException) -> Response:
    status, info = error_info(exc)
    headers = exc.headers if isinstance(exc, APIError) else None
    if isinstance(exc, RequestRejectedError):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return Response(
        error_body(info), status_code=status, headers=headers, media_type="application/json"
    )
