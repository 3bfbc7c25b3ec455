"""`--kv-transfer-config`: which role an instance plays in disaggregated prefill/decode.

The JSON shape is vLLM's, so a deployment script reads the same::

    {"kv_role": "kv_producer", "kv_connector": "shared-storage",
     "kv_connector_extra_config": {"storage_path": "/var/cache/kvflow-kv"}}

- kv_producer: a prefill instance; saves the KV of every prompt it completes.
- kv_consumer: a decode instance; loads KV from outside instead of computing it.
- kv_both: both (with shared storage, a disk prefix cache shared by every instance).

Connectors: `shared-storage` (files in a directory, keyed by the block-hash chain) and
`zmq` (a consumer pulls the blocks from the producer that `kv_transfer_params` names:
`{"kv_role": "kv_producer", "kv_connector": "zmq", "kv_connector_extra_config":
{"kv_port": 8200}}`).
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvflow.errors import ConfigError
from kvflow.json_options import json_options

if TYPE_CHECKING:
    from kvflow.config import EngineConfig

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("shared-storage", "zmq")
_PLANNED: tuple[str, ...] = ()  # named in the design, not built yet: refused clearly


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: KVRole
    kv_connector: str
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_role not in ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if self.kv_connector in _PLANNED:
            raise ConfigError(
                f"the {self.kv_connector!r} KV connector is not available yet; use 'shared-storage'"
            )
        if self.kv_connector not in CONNECTORS:
            raise ConfigError(
                f"kv_connector must be one of {', '.join(CONNECTORS)}, got {self.kv_connector!r}"
            )
        if self.kv_connector == "shared-storage" and not self.storage_path:
            raise ConfigError(
                "the shared-storage connector needs kv_connector_extra_config.storage_path"
            )
        if self.kv_connector == "zmq" and self.is_producer and not self.kv_port:
            raise ConfigError("a zmq producer needs kv_connector_extra_config.kv_port")

    @property
    def kv_host(self) -> str:
        """The zmq producer's bind address (loopback unless set)."""
        return str(self.kv_connector_extra_config.get("kv_host", "127.0.0.1"))

    @property
    def kv_port(self) -> int:
        return int(self.kv_connector_extra_config.get("kv_port", 0))

    @property
    def kv_buffer_bytes(self) -> int:
        """Most bytes a zmq producer keeps for consumers to pull (oldest dropped)."""
        return int(self.kv_connector_extra_config.get("kv_buffer_bytes", 1 << 30))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def storage_path(self) -> str:
        return str(self.kv_connector_extra_config.get("storage_path", ""))

    @classmethod
    def parse(cls, value: str | dict[str, Any] | KVTransferConfig) -> KVTransferConfig:
        """From the JSON text of the CLI flag or the dict `LLM(...)` takes."""
        if isinstance(value, KVTransferConfig):
            return value
        options = json_options(value, cls, "kv_transfer_config", ("kv_role", "kv_connector"))
        if not isinstance(options.get("kv_connector_extra_config", {}), dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")
        return cls(**options)


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """argparse `type=` of `--kv-transfer-config`: a bad value is a usage error."""
    try:
        return KVTransferConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def kv_namespace(model_id: str, dtype: str, block_size: int) -> str:
    """A short name for one KV layout: blocks saved by one model, dtype and block size
    must never be loaded by another, even from a directory that several instances share.
    Scheduler and worker derive it alike from the same (resolved) settings."""
    digest = hashlib.sha256(f"{model_id}\0{dtype}\0{block_size}".encode()).hexdigest()
    return digest[:16]


def engine_kv_namespace(config: EngineConfig) -> str:
    """The namespace of an engine's KV blocks (its --model as given: instances that
    share a directory name their model alike; resolved paths differ across hosts)."""
    dtype: str = config.model.dtype
    kv_dtype = config.cache.kv_cache_dtype
    if kv_dtype not in ("auto", dtype):  # a quantized cache: rows of another layout
        dtype = f"{dtype}/kv:{kv_dtype}"
    return kv_namespace(config.model.model or "embedded", dtype, config.cache.block_size)


def block_file_path(storage_path: str, namespace: str, key: str) -> str:
    """Where the shared-storage connector keeps one block: fanned out by the key's first
    byte so that no directory grows to millions of entries."""
    return f"{storage_path}/{namespace}/{key[:2]}/{key}.kv"
