"""The frontend's settings, with the model limits it validates requests against."""

from __future__ import annotations

import ssl
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvflow.errors import ConfigError
from kvflow.lora_config import LoRAConfig
from kvflow.media import MediaOptions
from kvflow.pooling import PoolingSpec
from kvflow.services.frontend.reasoning import reasoning_parser

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_STORED_RESPONSES = 1024


def new_frontend_id() -> str:
    return f"frontend-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class TlsConfig:
    """HTTPS for the API: uvicorn's ssl options under vLLM's flag names.

    `cert_reqs` is Python's ssl.VerifyMode: 0 no client certificate, 1 checked when
    sent, 2 required (mutual TLS); 1 and 2 check against `ca_certs`. `certfile` may hold
    the key too (then `keyfile` is None)."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE

    def __post_init__(self) -> None:
        if self.cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ConfigError(f"ssl_cert_reqs must be 0, 1 or 2, got {self.cert_reqs}")
        if self.cert_reqs != ssl.CERT_NONE and self.ca_certs is None:
            raise ConfigError("ssl_cert_reqs 1 or 2 checks client certificates: give ssl_ca_certs")

    def check_files(self) -> None:
        """ConfigError unless the files load as uvicorn will load them (at start-up,
        not once the engine has loaded)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
            if self.ca_certs is not None:
                context.load_verify_locations(self.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"TLS files do not load: {exc}") from None

    def uvicorn_options(self) -> dict[str, Any]:
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.ca_certs,
            "ssl_cert_reqs": self.cert_reqs,
        }


@dataclass(frozen=True)
class FrontendConfig:
    """Everything `build_app` needs besides the engine client and the tokenizer.

    `max_model_len` and `vocab_size` are the model's (the same numbers the scheduler
    and workers use): prompts and max_tokens are checked against them before a request
    reaches the engine.
    """

    served_model_name: str
    max_model_len: int
    vocab_size: int
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # Bearer token; None = open
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    frontend_id: str = field(default_factory=new_frontend_id)  # the detokenizer routes by it
    model_root: str = ""  # shown as `root` in /v1/models (the model's path)
    stats_timeout_s: float = 10.0  # no SchedulerStats for this long: unhealthy
    # A failed engine's requests with no other engine to go to wait this long for one
    # that serves again, then are resent (in_flight.py); 0: they end with an error.
    resend_wait_s: float = 60.0
    shutdown_grace_s: float = 5.0  # after SIGTERM, streams may run this long, then error
    engine_label: str = "0"  # `engine` label of request-level metrics
    # Several API servers on one port: where each publishes its request-level metrics,
    # so that a scrape of any of them returns the sum (metrics_fanin.py). None: alone.
    metrics_dir: str | None = None
    # /v1/responses kept for previous_response_id and GET (LRU; 0: none; response_store.py)
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    # Each engine's --max-waiting-requests (None: no limit): a request with more
    # samples than that is a 400 here, never admitted by an idle engine either.
    max_waiting_requests: int | None = None
    tls: TlsConfig | None = None  # None: plain HTTP
    lora: LoRAConfig | None = None  # --enable-lora: adapters served by name (lora_registry.py)
    model_dir: str = ""  # the base model's directory (its config.json checks adapters)
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts only (else a 400)

    @property
    def url(self) -> str:
        """Where clients reach the API."""
        scheme = "http" if self.tls is None else "https"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    reasoning_parser: str | None = None  # chat's think-tag split (reasoning.py); None: off
    # The pooling runner's pooler: /v1/embeddings and /pooling are served, generation is
    # refused (runner_routes.py). None: a generating server.
    pooling: PoolingSpec | None = None
    # Images in chat (kvflow/media.py): where they may come from and the limits; the
    # model directory when the model reads images (None: a text-only model).
    media: MediaOptions = MediaOptions()
    vision_model_dir: str | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.vocab_size < 1:
            raise ConfigError("max_model_len and vocab_size must be >= 1")
        if self.max_body_bytes < 1:
            raise ConfigError("max_body_bytes must be >= 1")
        if self.max_stored_responses < 0:
            raise ConfigError("max_stored_responses must be >= 0")
        reasoning_parser(self.reasoning_parser)  # an unknown name fails here, at start
        if "#" in self.frontend_id or not self.frontend_id:
            raise ConfigError("frontend_id must be non-empty and without '#'")
