"""Every ZeroMQ endpoint, derived from one base (an ipc directory or a tcp host:port).

`kvflow serve` uses a fresh ipc directory; compose runs each role in its own container
and passes `tcp://<service>:<port>` bases through flags or `KVFLOW_*` environment.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass

# Offsets from the tcp base port, one per channel.
_CHANNELS = {
    "scheduler_input": 0,  # frontends + detokenizer -> scheduler (PULL, bound by scheduler)
    "worker_plan": 1,  # scheduler -> workers (PUB, bound by scheduler)
    "worker_result": 2,  # workers -> scheduler (PULL, bound by scheduler)
    "detokenizer_input": 3,  # scheduler -> detokenizer (PULL, bound by detokenizer)
    "frontend_output": 4,  # detokenizer -> frontends (ROUTER, bound by detokenizer)
    "stats": 5,  # scheduler -> frontends (PUB, bound by scheduler)
}


@dataclass(frozen=True)
class ServiceAddresses:
    scheduler_input: str
    worker_plan: str
    worker_result: str
    detokenizer_input: str
    frontend_output: str
    stats: str

    @classmethod
    def ipc(cls, directory: str | None = None) -> ServiceAddresses:
        """Unix sockets in a private directory (one `kvflow serve` on one host)."""
        directory = directory or tempfile.mkdtemp(prefix=f"kvflow-{uuid.uuid4().hex[:8]}-")
        return cls(**{name: f"ipc://{directory}/{name}" for name in _CHANNELS})

    @classmethod
    def tcp(cls, hosts: dict[str, str], base_port: int) -> ServiceAddresses:
        """tcp endpoints; `hosts` maps a channel to the host that binds it."""
        return cls(
            **{
                name: f"tcp://{hosts.get(name, '127.0.0.1')}:{base_port + offset}"
                for name, offset in _CHANNELS.items()
            }
        )

    @classmethod
    def from_env(cls, prefix: str = "KVFLOW_ADDR_") -> ServiceAddresses | None:
        """`<prefix><CHANNEL>` for every channel (`KVFLOW_ADDR_STATS`, ...), or None if
        unset. Data-parallel engine i > 0 uses the prefix `KVFLOW_E<i>_ADDR_`."""
        values = {name: os.environ.get(f"{prefix}{name.upper()}") for name in _CHANNELS}
        if not all(values.values()):
            return None
        return cls(**values)  # type: ignore[arg-type]

    def as_env(self) -> dict[str, str]:
        return {f"KVFLOW_ADDR_{name.upper()}": getattr(self, name) for name in _CHANNELS}

    @staticmethod
    def channels() -> list[str]:
        return list(_CHANNELS)


def bind_address(address: str) -> str:
    """A connect address turned into its bind form (`tcp://host:p` -> `tcp://*:p`).

    A loopback host stays as it is: such an address is only reachable from this host,
    so listening on every interface would expose the port for nothing."""
    if address.startswith("tcp://"):
        host, port = address[len("tcp://") :].rsplit(":", 1)
        return address if host.startswith("127.") else f"tcp://*:{port}"
    return address
