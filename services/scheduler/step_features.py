"""What a scheduler step feature may do, and when the scheduler asks it.

The core loop (scheduler.py) knows budgets, queues, blocks and preemption; everything a
request option or a deployment adds (speculative decoding, KV transfer, pipeline
micro-batches, jump-forward, prompt logprobs) is one `StepFeature` object, registered
when the scheduler is assembled (features.py). Each hook is a no-op here, so a feature
overrides only the points it needs, and a scheduler without features pays one loop
over an empty list per point::

    arriving     on_add (a feature may keep a request out of the queue)
    schedule()   begin_step ─▶ running: holds_back ─▶ cap_tokens ─▶ plan_running
                                      ─▶ on_scheduled_running
                             waiting: stops_admission ─▶ skips_admission ─▶
                                      reads_prefix_cache ─▶ admission ─▶ cap_tokens
                                      ─▶ on_allocated
                 every scheduled request: on_scheduled ─▶ end_step (the plan's extras)
    results      on_result (the step's side outputs) ─▶ on_sampled (per request, before
                 its tokens) ─▶ on_tokens (all applied requests) ─▶ on_delta
    leaving      companions (requests that share a leaving request's fate)
                 on_preempt (recompute; step None: the worker was lost) ─▶ on_worker_lost
                 on_finish (finished or aborted)

Hooks run in registration order. A feature depends on the scheduler's public types
(Request, StepBuilder, proto messages), never on the scheduler itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.proto.engine import TokenDelta
from kvflow.proto.kv_transfer import KVConnectorMeta
from kvflow.proto.step import CachedRequestData, NewRequestData, StepPlan, StepResult
from kvflow.services.scheduler.kv_cache_manager import ComputedBlocks
from kvflow.services.scheduler.request import Request

if TYPE_CHECKING:
    from kvflow.services.scheduler.snapshot import FeatureStats


@dataclass
class StepBuilder:
    """Accumulates one step's plan while the budget is spent."""

    budget: int
    running: list[Request]  # the scheduler's running list (live: preemption shrinks it)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    scheduled: dict[str, int] = field(default_factory=dict)  # req_id -> tokens, batch order
    preempted: list[Request] = field(default_factory=list)
    to_preempt: list[Request] = field(default_factory=list)  # running; by features, at the end
    # The plan's feature fields, filled by the features.
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # req_id -> drafts
    forced_token_ids: dict[str, list[int]] = field(default_factory=dict)  # jump-forward
    kv_block_copies: list[list[int]] = field(default_factory=list)  # [src, dst] (beam search)
    kv_connector: KVConnectorMeta | None = None

    def add(self, request: Request, num_tokens: int) -> None:
        self.scheduled[request.request_id] = num_tokens
        self.budget -= num_tokens


@dataclass(frozen=True)
class Planned:
    """A feature's answer for a running request about to take `num_new` tokens: it
    allocated `num_tokens` (`block_ids` new), or `num_tokens == 0`: no step for it now."""

    num_tokens: int
    block_ids: list[int]


WAIT = Planned(0, [])


@dataclass(frozen=True)
class External:
    """Prompt tokens past the local prefix hit whose KV comes from outside; `parked`:
    they arrive in the background, and the request takes no step until they have."""

    num_tokens: int = 0
    parked: bool = False


NOTHING_EXTERNAL = External()


@dataclass
class ResultEvents:
    """What a feature decided from a step's result, besides the plain sampled tokens."""

    # To the waiting queue's front (new ones, e.g. a beam's fork, are registered too).
    requeue: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # finished with an error
    error: str = ""  # the failed requests' message
    taken: set[str] = field(default_factory=set)  # samples the feature applied itself
    dropped: list[Request] = field(default_factory=list)  # leave without a delta
    # Finished by the feature, with the tokens their last delta carries.
    finished: list[tuple[Request, list[int]]] = field(default_factory=list)


class StepFeature:
    """Base class: every hook does nothing (see the module docstring for the order)."""

    # ---- arrival -------------------------------------------------------------------

    def on_add(self, request: Request) -> list[Request] | None:
        """A request arrives: None to queue it as usual, or the requests to queue
        instead (the feature keeps `request`; it may raise InvalidRequestError)."""
        return None

    # ---- schedule time -------------------------------------------------------------

    def begin_step(self, step: StepBuilder) -> None:
        """A step starts being planned."""

    def holds_back(self, request: Request) -> bool:
        """A running request that takes no step now (before its tokens are counted)."""
        return False

    def cap_tokens(self, request: Request, num_new: int) -> int:
        """A request (running, or waiting past its prefix hit) is about to take
        `num_new` tokens from its num_computed_tokens: how many it may take (0: none
        this step; a waiting request then stops admission)."""
        return num_new

    def plan_running(self, request: Request, num_new: int, step: StepBuilder) -> Planned | None:
        """Schedule a running request differently from `num_new` plain tokens: a
        `Planned` (allocated by the feature, or WAIT), or None for the plain way."""
        return None

    def on_scheduled_running(
        self, request: Request, cached: CachedRequestData, step: StepBuilder
    ) -> None:
        """A running request's entry in the plan, before it is added."""

    def stops_admission(self, request: Request) -> bool:
        """The next waiting request cannot start now; nobody behind it starts either."""
        return False

    def reads_prefix_cache(self, request: Request) -> bool:
        """Whether a waiting request may start from a prefix-cache hit (False: it needs
        the model's outputs at every prompt position, so it computes them all)."""
        return True

    def skips_admission(self, request: Request) -> bool:
        """The next waiting request cannot start now; those behind it may."""
        return False

    def admission(self, request: Request, computed: ComputedBlocks) -> External | None:
        """KV a waiting request gets from outside (None: it cannot start now)."""
        return NOTHING_EXTERNAL

    def on_allocated(self, request: Request, num_local: int, external: External) -> None:
        """A waiting request got blocks for `external` tokens too."""

    def on_scheduled(self, request: Request, num_tokens: int, step: StepBuilder) -> None:
        """A request is in the plan; its num_computed_tokens already counts num_tokens."""

    def end_step(self, step: StepBuilder) -> None:
        """Every request is planned: fill the plan's feature fields."""

    def on_step_returned(self, plan: StepPlan) -> None:
        """The result of `plan` is back (before it is applied)."""

    # ---- results -------------------------------------------------------------------

    def on_result(self, result: StepResult) -> ResultEvents | None:
        """A step's result arrives, before any token is applied."""
        return None

    def on_sampled(self, request: Request, num_sampled: int) -> None:
        """`num_sampled` tokens came back for a running request (not yet appended)."""

    def on_tokens(self, applied: list[tuple[Request, list[int]]]) -> None:
        """Every request's sampled tokens are appended; a feature may append more
        (to the request and to its list: they go out in the same delta)."""

    def on_delta(self, delta: TokenDelta, first: bool) -> None:
        """A request's delta is about to go out (`first`: its first one)."""

    # ---- leaving -------------------------------------------------------------------

    def companions(self, request: Request) -> list[Request]:
        """Requests that are preempted or finished together with `request`."""
        return []

    def on_preempt(self, request: Request, step: StepBuilder | None) -> None:
        """`request` goes back to waiting to recompute (step None: the worker was lost)."""

    def on_worker_lost(self) -> list[Request]:
        """The worker died with its KV: drop state about it; returns requests the
        feature held that now wait again (they recompute)."""
        return []

    def on_finish(self, request: Request) -> None:
        """A request left (finished, aborted or failed)."""

    # ---- state ---------------------------------------------------------------------

    def has_background_work(self) -> bool:
        """Steps must go on even without requests (to hear a transfer end)."""
        return False

    def add_stats(self, stats: FeatureStats) -> None:
        """Contribute to the stats message (called once per message)."""
