"""The frontend's asyncio client of the engine cores, over ZeroMQ.

    frontend ──PUSH: AddRequest / AbortRequests──▶ scheduler_input   (scheduler binds)
    frontend ◀──DEALER (identity = frontend id)─── frontend_output   (detokenizer ROUTER)
    frontend ◀──SUB: SchedulerStats / EngineDead── stats             (scheduler PUB)

One such set of sockets per engine core (`EngineLink`; data parallelism runs several,
each with its own detokenizer). `Router` picks the engine of each new request among the
serving ones; every sample, abort and failure of a request stays with that engine.
Background tasks read the inbound sockets and route each `RequestOutputDelta` to
the queue of the request that owns it. A request with n > 1 samples is sent as n child
requests `<id>#<i>` that share one queue, so `generate()` yields their deltas merged.
The verdicts on the engines' health (`/health`, admission) are `EngineHealth`'s
(engine_health.py), over the links this client keeps up to date.

Invariants:
- every request `generate()` started ends: by a delta with a finish reason from the
  engine, by an error delta this client makes up when the engine is found dead, or by
  the consumer leaving, in which case AbortRequests for its unfinished children is sent
  (try/finally, so task cancellation after a client disconnect frees its KV blocks too);
- death is noticed per engine, three ways: an `EngineDead` message, a watchdog callable
  naming a dead child process, or no `SchedulerStats` for `stats_timeout_s` (the
  scheduler publishes about every 0.5 s, idle or not). Only that engine's requests fail;
  the others keep serving (`/health` says degraded). The stack's `watchdog` verdict is
  final for every engine (`kvflow serve` stops then); an `engine_watchdogs` verdict
  lasts until the engine's restart shows a new incarnation; stale stats recover when stats come back, but the requests in flight at
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
from collections.abc import AsyncGenerator, Callable, Sequence

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvflow.block_hash import ImageSpan
from kvflow.errors import EngineDeadError
from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.engine import AddRequest
from kvflow.proto.frontend import EngineDead, FrontendOutputs, RequestOutputDelta
from kvflow.proto.lora import LoRARequest
from kvflow.proto.multimodal import ImageInput, MRopePositions
from kvflow.proto.stats import SchedulerStats
from kvflow.routing import Decision, NoEngineError, Router, RoutingConfig
from kvflow.runtime.sockets import TypedSocket
from kvflow.sampling_params import SamplingParams, child_request_ids, child_sampling_params
from kvflow.services.frontend.engine_health import EngineHealth
from kvflow.services.frontend.engine_link import EngineLink
from kvflow.services.frontend.in_flight import (
    HeldRequest,
    InFlightRequests,
    SentRequest,
    error_delta,
)
from kvflow.services.frontend.request_deadline import Deadline

logger = logging.getLogger(__name__)

_FLUSH_ON_CLOSE_MS = 500
# Returns None while every engine process is alive, else what died ("worker 0 exited").
Watchdog = Callable[[], str | None]
StatsListener = Callable[[SchedulerStats], None]
RouteListener = Callable[[str, Decision], None]  # (engine label, decision)


# Put into a request's queue when its deadline passes (compared by identity).
_DEADLINE_PASSED = error_delta("", "deadline")


class EngineClient(EngineHealth, InFlightRequests):
    def __init__(
        self,
        addresses: ServiceAddresses | Sequence[ServiceAddresses],
        frontend_id: str,
        *,
        stats_timeout_s: float = 10.0,
        watchdog: Watchdog | None = None,
        engine_watchdogs: Sequence[Watchdog] | None = None,
        check_interval_s: float = 0.25,
        routing: RoutingConfig | None = None,
        resend_wait_s: float = 60.0,
    ) -> None:
        if isinstance(addresses, ServiceAddresses):
            addresses = [addresses]
        self.engines = [EngineLink(i, a) for i, a in enumerate(addresses)]
        self.frontend_id = frontend_id
        self.stats_timeout_s = stats_timeout_s
        self.watchdog = watchdog  # the whole stack's: a death it names is final
        self.engine_watchdogs = list(engine_watchdogs or [])  # one per engine: restartable
        self.check_interval_s = check_interval_s
        self.router = Router(routing or RoutingConfig(), len(self.engines))
        self.latest_stats: dict[str, SchedulerStats] = {}  # engine label -> newest stats
        self._listeners: list[StatsListener] = []
        self._route_listeners: list[RouteListener] = []
        self._queues: dict[str, asyncio.Queue[RequestOutputDelta]] = {}  # child id -> queue
        self._owners: dict[str, int] = {}  # child id -> the engine that holds it
        self._sent: dict[str, SentRequest] = {}  # child id -> what re-routing it would resend
        self.resend_wait_s = resend_wait_s
        self._held: dict[str, HeldRequest] = {}  # child id -> why and until when it waits
        self._context: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def addresses(self) -> ServiceAddresses:
        return self.engines[0].addresses

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Open every engine's sockets and start the reader and liveness tasks."""
        self._context = zmq.asyncio.Context()
        for engine in self.engines:
            engine.open(self._context, self.frontend_id)
            monitor = engine.output.monitor
            assert isinstance(monitor, zmq.asyncio.Socket)
            i = engine.index
            self._tasks += [
                asyncio.create_task(self._read_loop(engine.output, i), name=f"kvflow-outputs{i}"),
                asyncio.create_task(self._read_loop(engine.stats, i), name=f"kvflow-stats{i}"),
                asyncio.create_task(self._link_loop(monitor, i), name=f"kvflow-detok-link{i}"),
            ]
        self._tasks.append(asyncio.create_task(self._liveness_loop(), name="kvflow-liveness"))

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
        for engine in self.engines:
            engine.close(_FLUSH_ON_CLOSE_MS)
        if self._context is not None:
            self._context.term()
            self._context = None

    @property
    def started(self) -> bool:
        return any(engine.sockets for engine in self.engines)

    def add_stats_listener(self, listener: StatsListener) -> None:
        """`listener` sees every SchedulerStats message once, in arrival order."""
        self._listeners.append(listener)

    @property
    def engine_count(self) -> int:
        return len(self.engines)

    def add_route_listener(self, listener: RouteListener) -> None:
        """`listener` sees every routing decision (engine label, decision)."""
        self._route_listeners.append(listener)

    @property
    def num_in_flight(self) -> int:
        """Engine requests (samples) this frontend waits on."""
        return len(self._queues)

    # ---- requests ---------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        data_parallel_rank: int | None = None,
        deadline: Deadline | None = None,
        *,
        images: list[ImageInput] | None = None,
        lora_request: LoRARequest | None = None,
        mrope: MRopePositions | None = None,
        resume: list[list[int] | None] | None = None,
    ) -> AsyncGenerator[RequestOutputDelta, None]:
        """Deltas of all n samples as they come (`delta.req_id` names the child; see
        `sample_index`). Ends when every sample finished; an engine failure arrives as a
        delta with finish_reason "error" and `error` set. Raises EngineDeadError before
        sending anything when no engine (or not the asked one) serves, and
        RequestTimeoutError when `deadline` passes (the unfinished samples are aborted).
        Every sample goes to one engine: they share the prompt's KV blocks there. `resume`
        (kv_params.py): per sample, its output so far to go on from, None if finished."""
        assert "#" not in request_id, "'#' separates a request id from its sample index"
        resume = [[]] * params.n if resume is None else resume
        self.check_rank(data_parallel_rank)
        spans = [(i.offset, i.length, i.hash) for i in images or ()]
        engine = self._route(prompt_token_ids, cache_salt, data_parallel_rank, lora_request, spans)
        child_ids = [
            c for c, r in zip(child_request_ids(request_id, params.n), resume) if r is not None
        ]
        queue: asyncio.Queue[RequestOutputDelta] = asyncio.Queue()
        unfinished = set(child_ids)
        arrival = time.time() if arrival_time is None else arrival_time
        for child_id in child_ids:
            self._queues[child_id] = queue
            self._owners[child_id] = engine
        timer = None
        if deadline is not None:  # one timer, not a timeout per delta
            loop = asyncio.get_running_loop()
            timer = loop.call_at(deadline.at, queue.put_nowait, _DEADLINE_PASSED)
        try:
            request = AddRequest(
                request_id, prompt_token_ids, params, arrival, priority, cache_salt,
                self.frontend_id, images=images or [], lora_request=lora_request, mrope=mrope,
            )  # fmt: skip
            self._send_samples(engine, request, resume, data_parallel_rank is not None)
            while unfinished:
                delta = await queue.get()
                if delta is _DEADLINE_PASSED:
                    assert deadline is not None
                    raise deadline.error()
                if delta.finish_reason is not None:
                    unfinished.discard(delta.req_id)
                yield delta
        finally:
            if timer is not None:
                timer.cancel()
            self.release(child_ids, unfinished)

    def _send_samples(
        self, engine: int, request: AddRequest, resume: list[list[int] | None], pinned: bool
    ) -> None:
        """Each sample of `request` as its own request (its own seed), with its output so
        far (none that finished), remembered for a resend."""
        params = request.sampling_params
        for index, child_id in enumerate(child_request_ids(request.req_id, params.n)):
            tokens = resume[index]
            if tokens is None:
                continue
            child = msgspec.structs.replace(
                request, req_id=child_id, sampling_params=child_sampling_params(params, index),
                output_token_ids=list(tokens),
            )  # fmt: skip
            self._sent[child_id] = SentRequest(child, pinned, list(tokens))
            self.engines[engine].input.send(child)

    def _route(
        self, token_ids: list[int], cache_salt: str | None, rank: int | None,
        lora: LoRARequest | None = None, image_spans: Sequence[ImageSpan] = (),
        *, avoid: int | None = None,
    ) -> int:  # fmt: skip
        problems = self.engine_problems()
        for engine in self.engines:
            serving = problems[str(engine.index)] is None and engine.index != avoid
            self.router.set_available(engine.index, serving)
        try:
            lora_id = 0 if lora is None else lora.lora_int_id
            decision = self.router.route(token_ids, cache_salt, rank, lora_id, image_spans)
        except NoEngineError as exc:
            raise EngineDeadError(self.health_problem() or str(exc)) from exc
        for listener in self._route_listeners:
            listener(str(decision.engine), decision)
        return decision.engine

    # ---- background tasks -------------------------------------------------------------

    async def _read_loop(self, sock: TypedSocket[object], engine: int) -> None:
        while True:
            try:
                message = await sock.arecv()
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("dropped a malformed engine message: %s", exc)
                continue
            self._handle(message, engine)

    def _handle(self, message: object, engine: int = 0) -> None:
        match message:
            case FrontendOutputs(deltas=deltas):
                for delta in deltas:
                    queue = self._queues.get(delta.req_id)
                    if queue is None:  # aborted or failed already
                        continue
                    if self._owners.get(delta.req_id) != engine:
                        continue  # late output of an engine this request left
                    sent = self._sent.get(delta.req_id)
                    if delta.finish_reason == "abort" and sent is not None and sent.aborted_here:
                        continue  # the echo of the abort that preceded its resend
                    if sent is not None:
                        sent.observe(delta)
                    delta.engine_index = engine
                    queue.put_nowait(delta)
            case SchedulerStats():
                self._on_stats(message, engine)
            case EngineDead(reason=reason):
                # The engine's own verdict (say, its worker's restarts are spent): only
                # another engine can take its requests.
                self._mark_dead(engine, reason, hold=False)

    def _on_stats(self, stats: SchedulerStats, engine: int) -> None:
        link = self.engines[engine]
        if link.observe_incarnation(stats.incarnation):
            self._on_restart(engine)
        self.router.observe_load(engine, stats.num_waiting, stats.num_running)
        self.latest_stats[stats.engine] = stats
        link.stats_seen = time.monotonic()
        link.recovering = stats.recovering
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("a stats listener failed")

    def _on_restart(self, engine: int) -> None:
        # Aborted too: requests queued for the dead scheduler reach the new one.
        self.fail_engine(engine, f"the engine restarted (scheduler of engine {engine})", abort=True)
        self.router.forget(engine)  # its prefix cache died with it
        link = self.engines[engine]
        if link.dead_reason is not None and not link.dead_final:
            logger.warning("engine %d is back after: %s", engine, link.dead_reason)
            link.dead_reason = None

    def _mark_dead(
        self, engine: int, reason: str, *, final: bool = False, hold: bool = True
    ) -> None:
        link = self.engines[engine]
        if link.dead_reason is None:
            logger.error("engine %d is dead: %s", engine, reason)
            link.dead_reason = reason
        link.dead_final = link.dead_final or final
        self.fail_engine(engine, f"the engine died: {reason}", hold=hold and not link.dead_final)

    async def _link_loop(self, monitor: zmq.asyncio.Socket, engine: int) -> None:
        link = self.engines[engine]
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.linked = True
            elif event == zmq.EVENT_DISCONNECTED:
                link.linked = False
                self.fail_engine(engine, "lost the connection to the detokenizer", abort=True)

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            self.check_liveness()

    def check_liveness(self) -> None:
        """Ask the watchdogs, fail over the in-flight requests of engines gone silent,
        and resend held requests once an engine serves again."""
        global_death = _ask(self.watchdog)
        now = time.monotonic()
        for link in self.engines:
            if global_death is not None:
                self._mark_dead(link.index, global_death, final=True)
                continue
            if link.index < len(self.engine_watchdogs):
                death = _ask(self.engine_watchdogs[link.index])
                if death is not None:
                    self._mark_dead(link.index, death)
                    continue
            if link.dead_reason is not None:
                continue
            stale = link.stale_reason(now, self.stats_timeout_s)
            if stale is not None and not link.stale:
                logger.error("engine unresponsive: %s", stale)
                self.fail_engine(link.index, f"the engine is unresponsive: {stale}", abort=True)
            link.stale = stale is not None
        if self._held:
            self.resend_held(now)


def _ask(watchdog: Watchdog | None) -> str | None:
    if watchdog is None:
        return None
    try:
        return watchdog()
    except Exception:
        logger.exception("an engine watchdog failed")
        return None
