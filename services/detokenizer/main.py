"""The detokenizer process: the socket shell around `DetokenizerStreams`.

    PULL detokenizer_input  AddRequest | EngineOutputs | EngineDead | SchedulerHello |
                            Shutdown (bound)
    ROUTER frontend_output  FrontendOutputs | EngineDead to the frontend that owns a
                            request; frontends connect DEALERs whose identity is their
                            `frontend_id` (bound)
    PUSH scheduler_input    AbortRequests("stop") when a stop string matched

Its only input is one socket, so a blocking poll with a timeout (for SIGTERM) is the
whole loop: it has nothing else to do while no outputs arrive.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvflow.proto.addresses import ServiceAddresses, bind_address
from kvflow.proto.control import PeerRefusals
from kvflow.proto.engine import AbortRequests, AddRequest, EngineOutputs
from kvflow.proto.frontend import EngineDead, FrontendOutputs
from kvflow.proto.step import SchedulerHello, Shutdown
from kvflow.runtime.cluster_auth import REFUSALS
from kvflow.runtime.lifecycle import LauncherLink, StopFlag, close_flushing, run_role
from kvflow.runtime.sockets import TypedSocket
from kvflow.services.detokenizer.streams import DetokenizerStreams, Routed
from kvflow.tokenizer import load_decoding_tokenizer

logger = logging.getLogger(__name__)

DetokenizerInput = AddRequest | EngineOutputs | EngineDead | SchedulerHello | Shutdown
_POLL_MS = 200


def run_detokenizer(
    addresses: ServiceAddresses,
    model_dir: Path,
    skip_tokenizer_init: bool = False,
    *,
    launcher_address: str | None = None,
) -> int:
    """Run until Shutdown from the scheduler or SIGTERM (0), or a fatal error (1).
    `skip_tokenizer_init`: no tokenizer, every text delta is empty (token ids only)."""

    def body(context: zmq.Context, link: LauncherLink, stop: StopFlag) -> int:
        streams = DetokenizerStreams(load_decoding_tokenizer(model_dir, skip_tokenizer_init))
        shell = _DetokenizerShell(context, addresses, streams)
        link.ready()
        logger.info("detokenizer ready")
        try:
            while not stop.is_set():
                shell.report_refusals()
                message = shell.receive(_POLL_MS)
                if isinstance(message, Shutdown):
                    break
                if message is not None:
                    shell.handle(message)
        finally:
            shell.close()
        return 0

    return run_role("detokenizer", 0, launcher_address, body)


class _DetokenizerShell:
    def __init__(
        self, context: zmq.Context, addresses: ServiceAddresses, streams: DetokenizerStreams
    ) -> None:
        self.streams = streams
        self.inputs = TypedSocket.open(
            context,
            zmq.PULL,
            bind_address(addresses.detokenizer_input),
            bind=True,
            recv_type=DetokenizerInput,
        )
        self.frontends = TypedSocket.open(
            context, zmq.ROUTER, bind_address(addresses.frontend_output), bind=True
        )
        # Sending to an unknown identity raises instead of dropping silently.
        self.frontends.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.scheduler = TypedSocket.open(context, zmq.PUSH, addresses.scheduler_input, bind=False)
        self._refusals_reported = 0

    def close(self) -> None:
        self.inputs.close()
        close_flushing(self.frontends)
        close_flushing(self.scheduler)

    def report_refusals(self) -> None:
        """Tell the scheduler (whose stats reach /metrics) when peers were refused."""
        count = REFUSALS.count
        if count != self._refusals_reported:
            self._refusals_reported = count
            self.scheduler.send(PeerRefusals("detokenizer", count))

    def receive(self, timeout_ms: int) -> Any:
        try:
            return self.inputs.recv(timeout_ms=timeout_ms)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropped a malformed message: %s", exc)
            return None

    def handle(self, message: Any) -> None:
        match message:
            case AddRequest():
                self.streams.add(message)
            case EngineOutputs():
                self._deliver(self.streams.process(message))
            case EngineDead(reason=reason):
                logger.error("engine dead: %s", reason)
                for frontend_id in self.streams.fail_all():
                    self._send(frontend_id, EngineDead(reason))
            case SchedulerHello(incarnation=incarnation):
                # A (re)started scheduler: earlier requests will get no more outputs
                # (frontends fail them when they see the new incarnation).
                dropped = len(self.streams.streams)
                self.streams.fail_all()
                logger.info("scheduler %s started; dropped %d streams", incarnation, dropped)
            case _:
                logger.error("unexpected message %r", type(message).__name__)

    def _deliver(self, routed: Routed) -> None:
        for frontend_id, deltas in routed.by_frontend.items():
            self._send(frontend_id, FrontendOutputs(deltas))
        for abort in routed.aborts:
            self.scheduler.send(abort)

    def _send(self, frontend_id: str, message: FrontendOutputs | EngineDead) -> None:
        try:
            self.frontends.send(message, to=frontend_id.encode())
        except zmq.ZMQError as exc:
            # Nobody would read this frontend's streams: stop computing them.
            req_ids = self.streams.drop_frontend(frontend_id)
            logger.warning(
                "frontend %r unreachable (%s): aborting its %d requests",
                frontend_id,
                exc,
                len(req_ids),
            )
            if req_ids:
                self.scheduler.send(AbortRequests(req_ids))
