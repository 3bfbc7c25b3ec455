"""The frontend's asyncio client of the engine, over ZeroMQ.

    frontend ──PUSH: AddRequest / AbortRequests──▶ scheduler_input   (scheduler binds)
    frontend ◀──DEALER (identity = frontend id)─── frontend_output   (detokenizer ROUTER)
    frontend ◀──SUB: SchedulerStats / EngineDead── stats             (scheduler PUB)

Background tasks read the two inbound sockets and route each `RequestOutputDelta` to
the queue of the request that owns it. A request with n > 1 samples is sent as n child
requests `<id>#<i>` that share one queue, so `generate()` yields their deltas merged.

Invariants:
- every request `generate()` started ends: by a delta with a finish reason from the
  engine, by an error delta this client makes up when the engine is found dead, or by
  the consumer leaving, in which case AbortRequests for its unfinished children is sent
  (try/finally, so task cancellation after a client disconnect frees its KV blocks too);
- death is noticed three ways: an `EngineDead` message, a `watchdog` callable naming a
  dead child process, or no `SchedulerStats` for `stats_timeout_s` (the scheduler
  publishes about every 0.5 s, idle or not). A watchdog death is final (`kvflow serve`
  stops then); stale stats recover when stats come back, but the requests in flight at
  that moment are failed (and aborted) anyway, so no caller waits on an engine that may
  never answer. Until the first stats arrive the engine counts as not ready (503), not
  as dead;
- a lost worker is the scheduler's to recover: its stats say `recovering` (with the
  reason) until a worker is back, and the requests in flight wait and then go on
  where they stopped; meanwhile the engine is not healthy (503 "recovering: ...") and
  new requests are refused;
- a restarted scheduler (compose restarts a failed container) shows a new
  `incarnation` in its stats: the requests in flight are failed, since the old process
  took them with it, and an `EngineDead` the old one sent is forgotten;
- a lost connection to the detokenizer (it died, or restarts) fails the requests in
  flight at once (their text state died with it: a restarted detokenizer drops their
  deltas), and until the connection is back the frontend is not ready (503), so no new
  request's outputs can reach the detokenizer before this frontend is connected to it
  (it routes by the connection's identity and drops what it cannot route).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvflow.errors import EngineDeadError
from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.engine import AbortRequests, AddRequest
from kvflow.proto.frontend import EngineDead, FrontendInput, FrontendOutputs, RequestOutputDelta
from kvflow.proto.sockets import TypedSocket
from kvflow.proto.stats import SchedulerStats
from kvflow.sampling_params import SamplingParams, child_request_ids, child_sampling_params

logger = logging.getLogger(__name__)

_FLUSH_ON_CLOSE_MS = 500
# Returns None while every engine process is alive, else what died ("worker 0 exited").
Watchdog = Callable[[], str | None]
StatsListener = Callable[[SchedulerStats], None]


def sample_index(child_id: str) -> int:
    """Index of the sample a child request id stands for (0 when n == 1)."""
    _, sep, index = child_id.rpartition("#")
    return int(index) if sep else 0


def error_delta(child_id: str, reason: str) -> RequestOutputDelta:
    return RequestOutputDelta(child_id, "", [], finish_reason="error", error=reason)


class EngineClient:
    def __init__(
        self,
        addresses: ServiceAddresses,
        frontend_id: str,
        *,
        stats_timeout_s: float = 10.0,
        watchdog: Watchdog | None = None,
        check_interval_s: float = 0.25,
    ) -> None:
        self.addresses = addresses
        self.frontend_id = frontend_id
        self.stats_timeout_s = stats_timeout_s
        self.watchdog = watchdog
        self.check_interval_s = check_interval_s
        self.latest_stats: dict[str, SchedulerStats] = {}  # engine label -> newest stats
        self._stats_seen: dict[str, float] = {}  # engine label -> monotonic receive time
        self._listeners: list[StatsListener] = []
        self._queues: dict[str, asyncio.Queue[RequestOutputDelta]] = {}  # child id -> queue
        self._dead_reason: str | None = None
        self._dead_final = False  # a watchdog verdict: no restart will clear it
        self._incarnations: dict[str, str] = {}  # engine label -> its scheduler's id
        self._stale = False
        # The DEALER's link to the detokenizer: None until start() (tests drive a
        # client without sockets), then False until the handshake is done.
        self._detokenizer_linked: bool | None = None
        self._context: zmq.asyncio.Context | None = None
        self._sockets: list[TypedSocket[object]] = []
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Open the sockets and start the reader and liveness tasks (in the running loop)."""
        self._context = zmq.asyncio.Context()
        self._input = TypedSocket.open(
            self._context, zmq.PUSH, self.addresses.scheduler_input, bind=False
        )
        self._output = TypedSocket.open(
            self._context,
            zmq.DEALER,
            self.addresses.frontend_output,
            bind=False,
            recv_type=FrontendInput,
            identity=self.frontend_id.encode(),
            monitor_events=zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
        )
        self._stats = TypedSocket.open(
            self._context,
            zmq.SUB,
            self.addresses.stats,
            bind=False,
            recv_type=SchedulerStats | EngineDead,
            subscribe=b"",
        )
        self._detokenizer_linked = False
        monitor = self._output.monitor
        assert isinstance(monitor, zmq.asyncio.Socket)
        self._sockets = [self._input, self._output, self._stats]
        self._tasks = [
            asyncio.create_task(self._read_loop(self._output), name="kvflow-engine-outputs"),
            asyncio.create_task(self._read_loop(self._stats), name="kvflow-engine-stats"),
            asyncio.create_task(self._liveness_loop(), name="kvflow-engine-liveness"),
            asyncio.create_task(self._link_loop(monitor), name="kvflow-detokenizer-link"),
        ]

    async def close(self) -> None:
        """Abort and fail whatever is still in flight, then close the sockets."""
        if not self.started:
            return
        self.fail_all("the server is shutting down", abort=True)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        # The aborts just sent must still reach the scheduler (their KV blocks are
        # freed there): give the input socket a moment to flush instead of linger=0.
        self._input.socket.close(linger=_FLUSH_ON_CLOSE_MS)
        for sock in self._sockets[1:]:
            sock.close()
        self._sockets = []
        if self._context is not None:
            self._context.term()
            self._context = None

    @property
    def started(self) -> bool:
        return bool(self._sockets)

    def add_stats_listener(self, listener: StatsListener) -> None:
        """`listener` sees every SchedulerStats message once, in arrival order."""
        self._listeners.append(listener)

    # ---- health -----------------------------------------------------------------------

    def health_problem(self) -> str | None:
        """None if the engine looks alive, else why not."""
        if self._dead_reason is not None:
            return self._dead_reason
        if not self._stats_seen:
            # Not connected yet (or the scheduler never came up): refuse rather than
            # queue requests nobody may ever run.
            return "waiting for the engine: no scheduler stats received yet"
        recovering = [s.recovering for s in self.latest_stats.values() if s.recovering]
        if recovering:  # requests would wait for the worker: refuse them, say why
            return f"recovering: {recovering[0]}"
        if self._detokenizer_linked is False:
            return "waiting for the engine: not connected to the detokenizer"
        return self._stale_reason(time.monotonic())

    @property
    def is_healthy(self) -> bool:
        return self.health_problem() is None

    @property
    def num_in_flight(self) -> int:
        """Engine requests (samples) this frontend waits on."""
        return len(self._queues)

    def _stale_reason(self, now: float) -> str | None:
        for engine, seen in self._stats_seen.items():
            if now - seen > self.stats_timeout_s:
                return f"engine {engine} sent no stats for {now - seen:.1f} s"
        return None

    # ---- requests ---------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutputDelta, None]:
        """Deltas of all n samples as they come (`delta.req_id` names the child; see
        `sample_index`). Ends when every sample finished; an engine failure arrives as a
        delta with finish_reason "error" and `error` set. Raises EngineDeadError before
        sending anything when the engine is already known to be down."""
        assert "#" not in request_id, "'#' separates a request id from its sample index"
        problem = self.health_problem()
        if problem is not None:
            raise EngineDeadError(problem)
        child_ids = child_request_ids(request_id, params.n)
        queue: asyncio.Queue[RequestOutputDelta] = asyncio.Queue()
        unfinished = set(child_ids)
        arrival = time.time() if arrival_time is None else arrival_time
        for child_id in child_ids:
            self._queues[child_id] = queue
        try:
            for index, child_id in enumerate(child_ids):
                self._send_add(
                    child_id, prompt_token_ids, params, index, arrival, priority, cache_salt
                )
            while unfinished:
                delta = await queue.get()
                if delta.finish_reason is not None:
                    unfinished.discard(delta.req_id)
                yield delta
        finally:
            for child_id in child_ids:
                self._queues.pop(child_id, None)
            if unfinished:
                self.abort(sorted(unfinished))

    def _send_add(
        self,
        child_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int,
        arrival: float,
        priority: int,
        cache_salt: str | None,
    ) -> None:
        request = AddRequest(
            req_id=child_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=child_sampling_params(params, index),
            arrival_time=arrival,
            priority=priority,
            cache_salt=cache_salt,
            frontend_id=self.frontend_id,
        )
        self._input.send(request)

    def abort(self, child_ids: list[str]) -> None:
        """Tell the scheduler to drop these child requests and free their KV blocks."""
        if child_ids and self._sockets:
            self._input.send(AbortRequests(req_ids=child_ids, finish_reason="abort"))

    def fail_all(self, reason: str, *, abort: bool = False) -> None:
        """End every request in flight with an error delta (optionally aborting it)."""
        child_ids = list(self._queues)
        for child_id in child_ids:
            self._queues.pop(child_id).put_nowait(error_delta(child_id, reason))
        if abort:
            self.abort(child_ids)
        if child_ids:
            logger.warning("failed %d in-flight request(s): %s", len(child_ids), reason)

    # ---- background tasks -------------------------------------------------------------

    async def _read_loop(self, sock: TypedSocket[object]) -> None:
        while True:
            try:
                message = await sock.arecv()
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("dropped a malformed engine message: %s", exc)
                continue
            self._handle(message)

    def _handle(self, message: object) -> None:
        match message:
            case FrontendOutputs(deltas=deltas):
                for delta in deltas:
                    queue = self._queues.get(delta.req_id)
                    if queue is not None:  # else: aborted or failed already
                        queue.put_nowait(delta)
            case SchedulerStats():
                self._on_stats(message)
            case EngineDead(reason=reason):
                self._mark_dead(reason)

    def _on_stats(self, stats: SchedulerStats) -> None:
        known = self._incarnations.get(stats.engine)
        self._incarnations[stats.engine] = stats.incarnation
        if known is not None and known != stats.incarnation:
            self._on_restart(stats.engine)
        self.latest_stats[stats.engine] = stats
        self._stats_seen[stats.engine] = time.monotonic()
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("a stats listener failed")

    def _on_restart(self, engine: str) -> None:
        # Aborted too: requests queued for the dead scheduler reach the new one.
        self.fail_all(f"the engine restarted (scheduler of engine {engine})", abort=True)
        if self._dead_reason is not None and not self._dead_final:
            logger.warning("engine %s is back after: %s", engine, self._dead_reason)
            self._dead_reason = None

    def _mark_dead(self, reason: str, *, final: bool = False) -> None:
        if self._dead_reason is None:
            logger.error("engine is dead: %s", reason)
            self._dead_reason = reason
        self._dead_final = self._dead_final or final
        self.fail_all(f"the engine died: {reason}")

    async def _link_loop(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._detokenizer_linked = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._detokenizer_linked = False
                self.fail_all("lost the connection to the detokenizer", abort=True)

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            self.check_liveness()

    def check_liveness(self) -> None:
        """Ask the watchdog, and fail in-flight requests when stats went stale."""
        if self._dead_reason is not None:
            return
        if self.watchdog is not None:
            try:
                reason = self.watchdog()
            except Exception:
                logger.exception("the engine watchdog failed")
                reason = None
            if reason is not None:
                self._mark_dead(reason, final=True)
                return
        stale = self._stale_reason(time.monotonic())
        if stale is not None and not self._stale:
            logger.error("engine unresponsive: %s", stale)
            self.fail_all(f"the engine is unresponsive: {stale}", abort=True)
        self._stale = stale is not None
