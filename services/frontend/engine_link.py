"""The frontend's link to one engine core (one data-parallel rank): its three sockets
and what the frontend knows of its health.

    PUSH   scheduler_input   AddRequest / AbortRequests         (the engine's scheduler binds)
    DEALER frontend_output   FrontendOutputs / EngineDead       (the engine's detokenizer binds)
    SUB    stats             SchedulerStats / EngineDead        (the engine's scheduler binds)

An engine is serving when its stats arrived within `stats_timeout_s`, no death was
reported (EngineDead, or its watchdog), and the detokenizer link is up. A death is
forgotten when stats with a new scheduler incarnation arrive (the engine restarted),
unless it was final (the launcher's own watchdog: nothing will restart it). While
its stats say `recovering` (a worker crashed and is being restarted), it is not
serving either, but the requests in flight are kept: they resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.frontend import EngineDead, FrontendInput
from kvflow.proto.stats import SchedulerStats
from kvflow.runtime.sockets import TypedSocket

NOT_READY = "waiting for the engine: no scheduler stats received yet"
NOT_LINKED = "waiting for the engine: not connected to the detokenizer"


@dataclass
class EngineLink:
    index: int
    addresses: ServiceAddresses
    stats_seen: float | None = None  # monotonic receive time of the newest stats
    incarnation: str | None = None
    dead_reason: str | None = None
    dead_final: bool = False
    stale: bool = False
    # Why the engine waits for its worker to come back ("" while it serves): requests
    # in flight resume then, new ones are refused meanwhile.
    recovering: str = ""
    # None until open() (tests drive a client without sockets), then False until the
    # DEALER's handshake with the detokenizer is done.
    linked: bool | None = None
    sockets: list[TypedSocket[object]] = field(default_factory=list)

    def open(self, context: zmq.asyncio.Context, frontend_id: str) -> None:
        self.input = TypedSocket.open(context, zmq.PUSH, self.addresses.scheduler_input, bind=False)
        self.output = TypedSocket.open(
            context,
            zmq.DEALER,
            self.addresses.frontend_output,
            bind=False,
            recv_type=FrontendInput,
            identity=frontend_id.encode(),
            monitor_events=zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
        )
        self.stats = TypedSocket.open(
            context,
            zmq.SUB,
            self.addresses.stats,
            bind=False,
            recv_type=SchedulerStats | EngineDead,
            subscribe=b"",
        )
        self.linked = False
        self.sockets = [self.input, self.output, self.stats]

    def close(self, flush_ms: int) -> None:
        # Aborts just sent must still reach the scheduler (their KV blocks are freed
        # there): the input socket gets a moment to flush instead of linger=0.
        if self.sockets:
            self.input.socket.close(linger=flush_ms)
            for sock in self.sockets[1:]:
                sock.close()
        self.sockets = []

    def problem(self, now: float, stats_timeout_s: float) -> str | None:
        """None while this engine serves, else why not."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self.stats_seen is None:
            # Not connected yet (or the scheduler never came up): refuse rather than
            # queue requests nobody may ever run.
            return NOT_READY
        if self.recovering:
            return f"recovering: {self.recovering}"
        if self.linked is False:
            return NOT_LINKED
        return self.stale_reason(now, stats_timeout_s)

    def stale_reason(self, now: float, stats_timeout_s: float) -> str | None:
        if self.stats_seen is not None and now - self.stats_seen > stats_timeout_s:
            return f"engine {self.index} sent no stats for {now - self.stats_seen:.1f} s"
        return None

    def observe_incarnation(self, incarnation: str) -> bool:
        """True when this is a new scheduler (the engine restarted)."""
        known, self.incarnation = self.incarnation, incarnation
        return known is not None and known != incarnation
