"""Typed errors shared by every layer; the HTTP frontend maps them to status codes."""

from __future__ import annotations


class KvflowError(Exception):
    """Base class of every error kvflow raises on purpose."""


class InvalidRequestError(KvflowError):
    """The caller sent something we cannot serve (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(KvflowError):
    """The server or engine was configured with something it cannot run (an option out
    of range, a limit the model does not allow): a start-up error, never an HTTP 400."""


class PromptTooLongError(InvalidRequestError):
    """prompt + max_tokens does not fit the model's context (HTTP 400, like vLLM)."""


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served (missing or corrupt files, a rank above
    --max-lora-rank, modules or shapes the base lacks, a name loaded twice)."""


class ModelNotFoundError(KvflowError):
    """The named model is not served here or cannot be found on disk (HTTP 404)."""

    status_code = 404


class UnsupportedModelError(KvflowError):
    """The model exists but uses an architecture or feature kvflow does not implement."""


class EngineDeadError(KvflowError):
    """The scheduler or a worker died; in-flight requests fail (HTTP 500/503)."""


class RequestRejectedError(InvalidRequestError):
    """The engine turned away, or gave up on, a valid request because it is overloaded,
    not because of what it asks: HTTP `status_code` with Retry-After instead of a 400.
    An InvalidRequestError all the same for the engine: a per-request refusal that goes
    back as an error delta (its `code` on the wire), never a crash or a traceback."""

    code = "rejected"
    status_code = 503

    def __init__(self, message: str) -> None:
        super().__init__(message)


class QueueFullError(RequestRejectedError):
    """`max_waiting_requests` requests already wait for their first step (HTTP 429)."""

    code = "queue_full"
    status_code = 429


class QueueTimeoutError(RequestRejectedError):
    """The request waited longer than `max_queue_delay` for its first step (HTTP 503)."""

    code = "queue_timeout"
    status_code = 503


REJECTIONS: dict[str, type[RequestRejectedError]] = {
    cls.code: cls for cls in (QueueFullError, QueueTimeoutError)
}


class RequestTimeoutError(KvflowError):
    """The request's own `timeout` passed before it finished; it was aborted (HTTP 408)."""

    code = "timeout"
    status_code = 408
