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


class ModelNotFoundError(KvflowError):
    """The named model is not served here or cannot be found on disk (HTTP 404)."""

    status_code = 404


class UnsupportedModelError(KvflowError):
    """The model exists but uses an architecture or feature kvflow does not implement."""


class EngineDeadError(KvflowError):
    """The scheduler or a worker died; in-flight requests fail (HTTP 500/503)."""
