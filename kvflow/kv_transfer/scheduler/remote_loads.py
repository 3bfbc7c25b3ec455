"""Requests whose prompt KV is on its way from another instance (asynchronous loads).

    waiting ─▶ admitted with blocks for its whole prompt ─▶ park (WAITING_FOR_REMOTE_KV)
                                                             │ the worker pulls, in the
                                                             │ background, into those blocks
    StepResult.kv_transfer.finished_loading ─▶ ready ─▶ front of the waiting queue, its
                                                         KV computed but the last token
                                                         (it holds its blocks: the
                                                         scheduler allocates only its
                                                         next chunk)
               .failed_loading (producer gone, timeout) ─▶ recompute: blocks freed, the
                                                           prompt computed here
                                                         └▶ fail: the request errors

A parked request is neither running nor waiting, so it takes no step budget and holds
up nobody. Its blocks stay with it until the worker says the pull ended, even when the
request is aborted meanwhile: the pulling thread may still be writing into them, and a
block handed to another request before then could be overwritten under it. Blocks
being filled are hashed (allocate_slots hashes at allocation), so a request that would
hit them in the prefix cache waits until the load ends (`blocks_pending`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request, RequestStatus


@dataclass
class LoadOutcomes:
    ready: list[Request] = field(default_factory=list)  # KV in place: schedule them
    recompute: list[Request] = field(default_factory=list)  # blocks freed: prefill here
    failed: list[Request] = field(default_factory=list)  # policy "fail": finish with error


class RemoteKVLoads:
    def __init__(self, kv_cache: KVCacheManager, failure_policy: str) -> None:
        self.kv_cache = kv_cache
        self.failure_policy = failure_policy
        self.loading: dict[str, Request] = {}
        self.num_failures = 0
        self._abandoned: set[str] = set()  # aborted while loading: freed when it ends
        self._no_remote: set[str] = set()  # its load failed: never asked again
        self._ready: dict[str, Request] = {}  # loaded, holding blocks, not yet scheduled
        self._pending_blocks: set[int] = set()

    def __len__(self) -> int:
        return len(self.loading) - len(self._abandoned)

    def park(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[request.request_id] = request
        self._pending_blocks.update(self.kv_cache.get_block_ids(request.request_id))

    def blocks_pending(self, block_ids: list[int]) -> bool:
        return bool(self._pending_blocks) and not self._pending_blocks.isdisjoint(block_ids)

    def may_load(self, request: Request) -> bool:
        return request.request_id not in self._no_remote

    def abandon(self, request: Request) -> None:
        """Aborted while parked: the blocks wait for the load's end (module docstring)."""
        self._abandoned.add(request.request_id)

    def started(self, request: Request) -> None:
        """A ready request took its first step: its loaded KV is the worker's now."""
        self._ready.pop(request.request_id, None)

    def forget(self, request: Request) -> None:
        self._ready.pop(request.request_id, None)
        self._no_remote.discard(request.request_id)

    def on_outcomes(self, finished: list[str], failed: list[str]) -> LoadOutcomes:
        outcomes = LoadOutcomes()
        for req_id, ok in [(r, True) for r in finished] + [(r, False) for r in failed]:
            request = self.loading.pop(req_id, None)
            if request is None:
                continue
            self._pending_blocks.difference_update(self.kv_cache.get_block_ids(req_id))
            if req_id in self._abandoned:
                self._abandoned.discard(req_id)
                self.kv_cache.free(req_id, step_discarded=True)
            elif ok:
                request.status = RequestStatus.WAITING  # holding its blocks
                self._ready[req_id] = request
                outcomes.ready.append(request)
            else:
                self._fail(request, outcomes)
        return outcomes

    def _fail(self, request: Request, outcomes: LoadOutcomes) -> None:
        """Blocks freed and their hashes dropped: the KV in them may be partial."""
        self.num_failures += 1
        self.kv_cache.free(request.request_id, step_discarded=True)
        request.num_computed_tokens = 0
        if self.failure_policy == "recompute":
            request.status = RequestStatus.WAITING
            self._no_remote.add(request.request_id)
            outcomes.recompute.append(request)
        else:
            request.status = RequestStatus.FINISHED_ERROR
            outcomes.failed.append(request)

    def drop_all(self) -> list[Request]:
        """The worker died (its pulls and the KV they loaded with it): free every
        parked or ready request's blocks; returns the parked live ones, to wait again
        (ready ones still wait). All of them recompute."""
        for req_id, request in self._ready.items():
            self.kv_cache.free(req_id, step_discarded=True)
            request.num_computed_tokens = 0
            self._no_remote.add(req_id)
        self._ready.clear()
        requeue = []
        for req_id, request in self.loading.items():
            self.kv_cache.free(req_id, step_discarded=True)
            if req_id not in self._abandoned:
                request.status = RequestStatus.WAITING
                request.num_computed_tokens = 0
                self._no_remote.add(req_id)
                requeue.append(request)
        self.loading.clear()
        self._abandoned.clear()
        self._pending_blocks.clear()
        return requeue
