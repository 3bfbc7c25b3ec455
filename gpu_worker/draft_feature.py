"""The draft model (drafter.py) as a runner feature: before the target's forward it
fills in the plan's draft placeholders; after the verification it keeps the draft KV
of the accepted drafts.

The verifier (sample_step.py) reads `probs`, the distribution each draft was drawn
from, as the rejection sampler's q.
"""

from __future__ import annotations

import torch

from kvflow.gpu_worker.drafter import Drafter
from kvflow.gpu_worker.input_batch import InputBatch, ModelInputs
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.proto.step import StepPlan, StepResult


class DraftModelFeature(StepFeature):
    def __init__(self, drafter: Drafter, batch: InputBatch) -> None:
        self.drafter = drafter
        self.batch = batch
        self.probs: dict[int, torch.Tensor] = {}  # this step's: slot -> q [k, V]

    def before_forward(self, plan: StepPlan) -> None:
        """Forget what the plan forgets (a resumed request starts again from 0), then
        propose the drafts of the speculating requests."""
        self.drafter.forget(plan.finished_req_ids)
        if plan.new_requests:
            self.drafter.forget([new.req_id for new in plan.new_requests])
        self.probs = {}
        if plan.spec_token_ids:
            self.probs = self.drafter.propose(self.batch, list(plan.spec_token_ids))

    def after_step(
        self, plan: StepPlan, inputs: ModelInputs, logits: torch.Tensor, result: StepResult
    ) -> None:
        if not self.probs:
            return
        # A verified request's tokens are its accepted drafts and one more.
        accepted = [len(tokens) - 1 for tokens in result.sampled_token_ids]
        self.drafter.on_verified(result.req_ids, accepted)

    def clear(self) -> None:
        self.drafter.clear()
        self.probs = {}
