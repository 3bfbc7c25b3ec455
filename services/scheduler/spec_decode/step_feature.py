"""Speculative decoding as a scheduler step feature: drafts into the plan, the
rejected ones rolled back when the verification comes back.

    decode with every token known ─▶ propose k drafts ─▶ allocate 1 + k slots
        ─▶ plan: the last token + the drafts (spec_token_ids), num_spec_in_flight = k
    result: accepted + 1 tokens ─▶ the rejected positions count as not computed

A request with a verification in flight takes no step (its next position is not known
yet), and a request that would speculate waits for a sample in flight (drafts need
every token known). When the room for the drafts is not there, it decodes plainly
rather than preempting others.
"""

from __future__ import annotations

from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.snapshot import FeatureStats
from kvflow.services.scheduler.spec_decode.speculator import Speculator
from kvflow.services.scheduler.step_features import (
    WAIT,
    Planned,
    StepBuilder,
    StepFeature,
)


class SpecDecodeFeature(StepFeature):
    def __init__(self, speculator: Speculator, kv_cache: KVCacheManager, max_model_len: int):
        self.speculator = speculator
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len

    def holds_back(self, request: Request) -> bool:
        return request.num_spec_in_flight is not None

    def plan_running(self, request: Request, num_new: int, step: StepBuilder) -> Planned | None:
        if num_new != 1 or not self._speculates(request, len(step.running)):
            return None
        if request.num_output_placeholders > 0:
            return WAIT  # drafts need every token known: wait for the one in flight
        drafts = self._propose(request, step.budget)
        if not drafts:
            return None
        new_block_ids = self.kv_cache.allocate_slots(request, 1 + len(drafts))
        if new_block_ids is None:
            return None
        step.spec_tokens[request.request_id] = drafts
        return Planned(1 + len(drafts), new_block_ids)

    def _speculates(self, request: Request, num_running: int) -> bool:
        """Whether this decode of `request` should come with drafts (once per decode
        scheduled: the speculator's off-switches count these). Guided requests decode
        without drafts: verifying them would need a grammar mask per draft position."""
        params = request.sampling_params
        if not params.speculative or params.structured_outputs:
            return False
        return self.speculator.wants(request.request_id, num_running)

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Drafts that never reach past max_tokens or the context, even if all are
        accepted and a bonus token follows."""
        max_drafts = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return self.speculator.propose(
            request.request_id, request.all_token_ids, request.num_prompt_tokens, max_drafts
        )

    def on_scheduled(self, request: Request, num_tokens: int, step: StepBuilder) -> None:
        drafts = step.spec_tokens.get(request.request_id)
        if drafts is not None:  # verifies its drafts, then samples one more token
            request.num_spec_in_flight = len(drafts)
            request.num_output_placeholders += 1

    def on_sampled(self, request: Request, num_sampled: int) -> None:
        """A verification step computed KV for the last token and k drafts; the accepted
        ones (num_sampled - 1) stay, the rejected positions count as not computed, and
        the next step writes over them. Their blocks stay with the request for that
        (freed with it), and were never hashed: hashes cover known tokens only."""
        num_drafts = request.num_spec_in_flight
        if num_drafts is None:
            return
        num_accepted = num_sampled - 1
        request.num_computed_tokens -= num_drafts - num_accepted
        request.num_spec_in_flight = None
        self.speculator.on_verified(request.request_id, num_drafts, num_accepted)

    def on_preempt(self, request: Request, step: StepBuilder | None) -> None:
        if step is not None:
            step.spec_tokens.pop(request.request_id, None)

    def on_finish(self, request: Request) -> None:
        self.speculator.finish(request.request_id, request.all_token_ids, request.num_prompt_tokens)

    def add_stats(self, stats: FeatureStats) -> None:
        stats.spec_decode = self.speculator.counters
