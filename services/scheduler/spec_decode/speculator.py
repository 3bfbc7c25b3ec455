"""The scheduler's side of speculative decoding: which requests speculate, their drafts,
and what happened to them (acceptance, metrics).

A request speculates when the config has a method, its own `SamplingParams.speculative`
is on, it is not guided (structured outputs), the batch is at most `disable_by_batch_size` running requests, and its recent
acceptance is not too low. The low-acceptance off-switch: once a request has drafted
`acceptance_window` tokens, if fewer than `min_acceptance_rate` of them were accepted,
it decodes plainly for `acceptance_window` steps, then tries again from a clean slate
(so a request whose text turns repetitive later gets its speed-up back). Each window
that fails again in a row doubles the plain stretch (up to MAX_BACKOFF windows): a
window of drafting costs about `acceptance_window / k` verification steps, which for a
draft model that costs 3 plain steps each is most of the loss on text it cannot
predict, so a hopeless request retries ever more rarely. A step where
the proposer found nothing counts as k rejected drafts here (not in the metrics).

Counters follow vLLM's metric names (kvflow:spec_decode_*): drafts (verification
steps with at least one draft), draft tokens, accepted tokens, accepted per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvflow.services.scheduler.spec_decode.ngram import NgramProposer
from kvflow.services.scheduler.spec_decode.suffix import SuffixProposer
from kvflow.services.scheduler.spec_decode.worker_draft import WorkerDraftProposer
from kvflow.speculative_config import SpeculativeConfig

MAX_BACKOFF = 32  # the longest plain stretch, in acceptance windows


class Proposer(Protocol):
    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int
    ) -> list[int]: ...

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None: ...


@dataclass
class SpecDecodeCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


@dataclass
class _Acceptance:
    drafted: int = 0
    accepted: int = 0
    cooldown: int = 0  # plain steps left before speculating again
    failures: int = 0  # windows below the rate in a row


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.counters = SpecDecodeCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._acceptance: dict[str, _Acceptance] = {}

    def wants(self, req_id: str, num_running: int) -> bool:
        """Whether a request about to decode should speculate now; called once per
        decode step of it (a step in the low-acceptance cool-down counts down)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return False
        state = self._acceptance.setdefault(req_id, _Acceptance())
        if state.cooldown > 0:
            state.cooldown -= 1
            return False
        return True

    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, max_drafts: int
    ) -> list[int]:
        """At most `max_drafts` drafts for a request all of whose tokens are known."""
        if max_drafts <= 0:
            return []
        k = min(self.config.num_speculative_tokens, max_drafts)
        drafts = self.proposer.propose(req_id, token_ids, num_prompt_tokens, k)
        if not drafts:
            # Nothing to copy counts as k rejected drafts for the off-switch: the step
            # gained nothing, and with async scheduling it still cost the overlap.
            self._count(req_id, self.config.num_speculative_tokens, 0)
        return drafts

    def on_verified(self, req_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        self.counters.record(num_draft_tokens, num_accepted)
        self._count(req_id, num_draft_tokens, num_accepted)

    def _count(self, req_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        state = self._acceptance.setdefault(req_id, _Acceptance())
        state.drafted += num_draft_tokens
        state.accepted += num_accepted
        window = self.config.acceptance_window
        if state.drafted >= window:
            if state.accepted < self.config.acceptance_rate_floor * state.drafted:
                state.cooldown = window * min(1 << state.failures, MAX_BACKOFF)
                state.failures += 1
            else:
                state.failures = 0
            state.drafted = state.accepted = 0

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._acceptance.pop(req_id, None)
        self.proposer.finish(req_id, token_ids, num_prompt_tokens)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer.from_config(config)
    if config.method == "draft_model":
        return WorkerDraftProposer()
    raise AssertionError(f"unexpected method {config.method}")


def make_speculator(config: SpeculativeConfig | None) -> Speculator | None:
    return None if config is None else Speculator(config)


def spec_decode_stats(counters: SpecDecodeCounters | None) -> dict[str, Any]:
    """The `SchedulerStats` fields of the counters (none without speculative decoding)."""
    if counters is None:
        return {}
    return {
        "spec_decode_num_drafts": counters.num_drafts,
        "spec_decode_num_draft_tokens": counters.num_draft_tokens,
        "spec_decode_num_accepted_tokens": counters.num_accepted_tokens,
        "spec_decode_accepted_per_pos": list(counters.accepted_per_pos),
    }
