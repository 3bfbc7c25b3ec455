"""Beam search as a scheduler step feature: a request group whose beams fork in the
engine and share their KV blocks, copy-on-write.

A search arrives as its `num_outputs` result requests ("<id>#<i>", as n samples do).
They are parked (WAITING_FOR_BEAMS) until it ends; the search runs on *beam* requests
of its own ("<id>#beam<j>"), plain greedy requests to the worker that report their
top-K logprobs. One round::

    every running beam computes one token and reports its top-K ─▶ held until all have
    BeamSearch.step (beam_search.py) ─▶ the next beams, each (parent, token):
        a parent's first child continues the parent's request (its token reaches the
            worker as the next step's `new_token_ids`, over the worker's own sample)
        every further child forks: KVCacheManager.fork shares the parent's full blocks
            (one more reference each) and copies only its partial last block (the next
            plan's `kv_block_copies`, made by the worker before the forward); the fork
            enters at the waiting queue's front holding its KV, so only its new token
            is computed. When the pool lacks the forks' blocks, every next beam
            recomputes instead (on prefix-cache hits): no beam holds KV while a
            sibling waits for blocks
        a parent without children leaves, freeing what no other beam shares
    when the search ends: the results take the best hypotheses, the beams leave

Steps in flight: a beam takes no step while its sample is out, so async scheduling
runs beams one step at a time (other requests still overlap). Progress under a full
cache: preempting any beam preempts its whole group (`companions`) and the round restarts
on recomputed beams; later beams are admitted first (`Request.expedite`); and a step
that can run nothing while reported beams wait preempts those groups (`end_step`).
Aborting any result aborts it all.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import msgspec

from kvflow.errors import InvalidRequestError
from kvflow.proto.engine import TokenDelta
from kvflow.proto.step import CachedRequestData, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.beam_search import BeamSearch
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.step_features import ResultEvents, StepBuilder, StepFeature


@dataclass
class BeamGroup:
    """One search: its parked results, its running beams (aligned with the search's
    scores) and the top-K each has reported this round."""

    parent_id: str
    search: BeamSearch
    stop_ids: frozenset[int]
    outputs: dict[int, Request] = field(default_factory=dict)  # result index -> request
    beams: list[Request] = field(default_factory=list)
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=itertools.count)

    def new_beam(self, template: Request, output_ids: list[int]) -> Request:
        beam = Request(
            f"{self.parent_id}#beam{next(self.ids)}",
            template.prompt_token_ids,
            _beam_params(template, self.search.num_candidates),
            eos_token_ids=template.eos_token_ids,
            arrival_time=template.arrival_time,
            priority=template.priority,
            cache_salt=template.cache_salt,
            max_tokens=template.max_tokens,
        )
        beam.all_token_ids.extend(output_ids)
        beam.expedite = bool(output_ids)  # a later beam: the search is under way
        return beam

    def members(self) -> list[Request]:
        return list(self.outputs.values()) + self.beams


class BeamSearchFeature(StepFeature):
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.groups: dict[str, BeamGroup] = {}  # request id (result or beam) -> its group
        self._forming: dict[str, BeamGroup] = {}  # parent id -> a group awaiting results
        self._copies: list[list[int]] = []  # for the next plan
        self._next_token: dict[str, int] = {}  # continuing beam -> its token, for the worker
        self.num_forks = 0  # forks that shared KV blocks (tests, stats)
        self.num_recomputed_rounds = 0  # rounds whose forks did not fit the pool
        self.num_stall_preemptions = 0  # groups preempted because nothing could run
        self._logprobs: dict[str, float] = {}  # finished result -> its beam's logprob sum

    # ---- arrival -------------------------------------------------------------------

    def on_add(self, request: Request) -> list[Request] | None:
        beam = request.sampling_params.beam_search
        if beam is None:
            return None
        self._check_fits(request, beam.beam_width)
        parent_id, index = _parent_and_index(request.request_id, beam.num_outputs)
        group = self._forming.get(parent_id)
        if group is None:
            group = BeamGroup(parent_id, _new_search(request), _stop_ids(request))
            self._forming[parent_id] = group
        group.outputs[index] = request
        request.status = RequestStatus.WAITING_FOR_BEAMS
        self.groups[request.request_id] = group
        if len(group.outputs) < beam.num_outputs:
            return []  # the other results are on their way
        del self._forming[parent_id]
        first = group.new_beam(request, [])
        group.beams.append(first)
        self.groups[first.request_id] = group
        return [first]

    def _check_fits(self, request: Request, beam_width: int) -> None:
        if beam_width > self.max_num_seqs:
            raise InvalidRequestError(
                f"beam search with {beam_width} beams needs as many sequences; the engine "
                f"runs at most max_num_seqs={self.max_num_seqs}",
                param="n",
            )
        # The prompt's full blocks are shared; each beam may need the rest on its own.
        block_size = self.kv_cache.block_size
        shared, partial = divmod(request.num_prompt_tokens, block_size)
        needed = shared + beam_width * math.ceil((partial + request.max_tokens) / block_size)
        if needed > self.kv_cache.num_blocks:
            raise InvalidRequestError(
                f"beam search with {beam_width} beams may need {needed} KV blocks but the "
                f"cache holds {self.kv_cache.num_blocks}; lower n/best_of or max_tokens",
                param="max_tokens",
            )

    # ---- schedule time -------------------------------------------------------------

    def holds_back(self, request: Request) -> bool:
        group = self.groups.get(request.request_id)
        if group is None:
            return False
        # Its sample is out, or it reported and waits for its siblings.
        return request.num_output_placeholders > 0 or request.request_id in group.reports

    def on_scheduled_running(
        self, request: Request, cached: CachedRequestData, step: StepBuilder
    ) -> None:
        token = self._next_token.pop(request.request_id, None)
        if token is not None:  # the search's token, over the one the worker sampled
            cached.new_token_ids = [token]

    def end_step(self, step: StepBuilder) -> None:
        step.kv_block_copies, self._copies = self._copies, []
        if step.scheduled or step.preempted:
            return
        # Nothing could run: beams that reported may hold the blocks their waiting
        # siblings need. Preempting every such group frees them all; the queue's first
        # group then fits the cache alone (`_check_fits`), and so on.
        for group in {id(g): g for g in self.groups.values()}.values():
            held = [b for b in group.beams if b.request_id in group.reports]
            if held and any(b.status != RequestStatus.RUNNING for b in group.beams):
                step.to_preempt.append(held[0])  # the group's others go with it
                for beam in group.beams:  # the siblings they waited for go first now
                    beam.expedite = beam.status != RequestStatus.RUNNING
                self.num_stall_preemptions += 1

    # ---- results -------------------------------------------------------------------

    def on_result(self, result: StepResult) -> ResultEvents | None:
        events = None
        for index, req_id in enumerate(result.req_ids):
            group = self.groups.get(req_id)
            if group is None:
                continue
            events = events or ResultEvents()
            events.taken.add(req_id)
            beam = next(b for b in group.beams if b.request_id == req_id)
            beam.num_output_placeholders = 0
            beam.expedite = True  # the search is under way (if it recomputes, first)
            top = result.logprobs[index][0]  # [0] is the worker's own sample
            group.reports[req_id] = list(zip(top.token_ids[1:], top.logprobs[1:]))
            if len(group.reports) == len(group.beams):
                self._advance(group, events)
        return events

    def _advance(self, group: BeamGroup, events: ResultEvents) -> None:
        beams = group.beams
        top = [group.reports[b.request_id] for b in beams]
        generated = [b.output_token_ids for b in beams]
        nexts = group.search.step(top, generated, group.stop_ids.__contains__)
        group.reports.clear()
        if group.search.done:
            self._finish(group, events)
            return
        first_child: dict[int, int] = {}  # parent -> index of its first continuation
        for i, continuation in enumerate(nexts):
            first_child.setdefault(continuation.parent, i)
        for parent, beam in enumerate(beams):
            if parent not in first_child:  # its KV goes now: the forks may need the room
                self._drop(beam, events)
        forks = [(i, c) for i, c in enumerate(nexts) if first_child[c.parent] != i]
        if not self._forks_fit([beams[c.parent] for _, c in forks]):
            # Every next beam recomputes instead (its full blocks are prefix-cache hits),
            # so that no beam holds KV while a sibling waits for blocks.
            group.beams = [self._fork(group, beams[c.parent], c.token_id, events, False)
                           for c in nexts]  # fmt: skip
            self.num_recomputed_rounds += 1
            for parent in first_child:
                self._drop(beams[parent], events)
            return
        new_beams = [self._fork(group, beams[c.parent], c.token_id, events) for _, c in forks]
        for i, continuation in enumerate(nexts):  # after the forks: they copy the parent
            if first_child[continuation.parent] == i:
                kept = beams[continuation.parent]  # continues in place, the first child
                kept.append_output_token(continuation.token_id)
                self._next_token[kept.request_id] = continuation.token_id
                new_beams.insert(i, kept)
        group.beams = new_beams

    def _forks_fit(self, parents: list[Request]) -> bool:
        """Whether the pool has the blocks of these forks: each a copy of its parent's
        partial block (or none at a boundary) and room for its new token."""
        block_size = self.kv_cache.block_size
        needed = sum(
            -(-(p.num_computed_tokens + 1) // block_size) - p.num_computed_tokens // block_size
            for p in parents
        )
        return needed <= self.kv_cache.num_free_blocks

    def _fork(
        self,
        group: BeamGroup,
        parent: Request,
        token_id: int,
        events: ResultEvents,
        share: bool = True,  # False: the child recomputes its KV
    ) -> Request:
        child = group.new_beam(parent, [*parent.output_token_ids, token_id])
        self.groups[child.request_id] = group
        if share:
            copies = self.kv_cache.fork(parent, child.request_id)
            assert copies is not None, "_forks_fit counted the blocks"
            child.num_computed_tokens = parent.num_computed_tokens
            self._copies += copies
            self.num_forks += 1
        events.requeue.append(child)
        return child

    def _drop(self, beam: Request, events: ResultEvents) -> None:
        """The beam leaves; its KV goes now (the scheduler's release finds none)."""
        self.kv_cache.free(beam.request_id)
        events.dropped.append(beam)

    def _finish(self, group: BeamGroup, events: ResultEvents) -> None:
        for beam in group.beams:
            self._drop(beam, events)
        group.beams = []
        hypotheses = group.search.best(len(group.outputs))
        for index, output in sorted(group.outputs.items()):
            hypothesis = hypotheses[index]
            output.all_token_ids.extend(hypothesis.token_ids)
            if hypothesis.stopped:
                output.status = RequestStatus.FINISHED_STOPPED
                last = hypothesis.token_ids[-1]
                if last in (output.sampling_params.stop_token_ids or ()):
                    output.stop_reason = last
            else:
                output.status = RequestStatus.FINISHED_LENGTH
            events.finished.append((output, list(hypothesis.token_ids)))
            self._logprobs[output.request_id] = float(hypothesis.logprob)

    def on_delta(self, delta: TokenDelta, first: bool) -> None:
        logprob = self._logprobs.pop(delta.req_id, None)
        if logprob is not None:
            delta.cumulative_logprob = logprob

    # ---- leaving -------------------------------------------------------------------

    def companions(self, request: Request) -> list[Request]:
        group = self.groups.get(request.request_id)
        if group is None or group.search.done:
            return []
        return [r for r in group.members() if r is not request and not r.is_finished]

    def on_preempt(self, request: Request, step: StepBuilder | None) -> None:
        group = self.groups.get(request.request_id)
        if group is not None:  # the round restarts: every beam recomputes and reports
            group.reports.pop(request.request_id, None)
            self._next_token.pop(request.request_id, None)

    def on_worker_lost(self) -> list[Request]:
        """The KV is gone: forks waiting with copied blocks recompute as well."""
        self._copies = []
        for req_id, group in self.groups.items():
            fork = next((b for b in group.beams if b.request_id == req_id), None)
            if fork is not None and fork.status == RequestStatus.WAITING:
                self.kv_cache.free(req_id, step_discarded=True)
                fork.reset_for_recompute()
                group.reports.pop(req_id, None)
        return []

    def on_finish(self, request: Request) -> None:
        group = self.groups.pop(request.request_id, None)
        self._next_token.pop(request.request_id, None)
        self._logprobs.pop(request.request_id, None)
        if group is None:
            return
        self._forming.pop(group.parent_id, None)  # a member left: it cannot start
        if request in group.beams:
            group.beams.remove(request)


def _parent_and_index(req_id: str, num_outputs: int) -> tuple[str, int]:
    """ "<id>#<i>" for n results, "<id>" for one (`child_request_ids`)."""
    if num_outputs == 1:
        return req_id, 0
    parent, _, index = req_id.rpartition("#")
    if not parent or not index.isdigit() or int(index) >= num_outputs:
        raise InvalidRequestError(f"beam search result id {req_id!r} is not '<id>#<index>'")
    return parent, int(index)


def _stop_ids(request: Request) -> frozenset[int]:
    params = request.sampling_params
    eos = frozenset() if params.ignore_eos else request.eos_token_ids
    return eos | frozenset(params.stop_token_ids or ())


def _new_search(request: Request) -> BeamSearch:
    beam = request.sampling_params.beam_search
    assert beam is not None
    return BeamSearch(
        beam.beam_width,
        len(_stop_ids(request)),
        beam.length_penalty,
        beam.early_stopping,
        request.max_tokens,
    )


def _beam_params(template: Request, num_candidates: int) -> SamplingParams:
    """A beam's worker parameters: greedy, reporting the top-K logprobs (raw: before any
    logits processing, as transformers' beam search reads them)."""
    return msgspec.structs.replace(
        template.sampling_params,
        temperature=0.0,
        logprobs=num_candidates,
        beam_search=None,
        speculative=False,
        min_tokens=0,
        seed=None,
    )
