"""The scheduler's half of the `draft_model` method: the draft model runs in the worker
(gpu_worker/drafter.py), so the scheduler proposes k placeholders. They reserve KV
slots and budget like any drafts; the worker fills in the draft model's tokens before
the target verifies them, and the accepted ones come back as sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.speculative_config import WORKER_DRAFT_TOKEN


class WorkerDraftProposer:
    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int
    ) -> list[int]:
        return [WORKER_DRAFT_TOKEN] * k  # a draft model always proposes k

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        pass  # the worker forgets the request when the plan says so
