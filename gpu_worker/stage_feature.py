"""A pipeline stage as a runner feature (stage_link.py moves the activations).

The stage posts its receive as the plan arrives (the activations land while the batch
is prepared), runs its layers from the previous stage's activations, and hands its own
on; only the last stage computes logits and samples, and its result carries every
stage's busy spans.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.gpu_worker.input_batch import ModelInputs
from kvflow.gpu_worker.parallel_state import get_pp_group
from kvflow.gpu_worker.stage_link import StageLink
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.proto.step import StepPlan, StepResult


class PipelineStage(StepFeature):
    def __init__(self, link: StageLink) -> None:
        self.link = link

    def on_plan(self, plan: StepPlan) -> None:
        if plan.scheduled_req_ids:
            self.link.begin(plan.total_num_scheduled_tokens)

    def forward(
        self, model: nn.Module, inputs: ModelInputs, after_layer: AfterLayer | None
    ) -> torch.Tensor | None:
        """This stage's part of the forward (a `ForwardPath`): the last stage's normed
        hidden of the logits rows, or None once the activations are on their way."""
        out = model(inputs.input_ids, inputs.positions, self.link.activations())
        if self.link.group.is_last:
            return out[inputs.metadata.logits_indices]  # type: ignore[no-any-return]
        self.link.send(out)
        return None

    def after_step(
        self, plan: StepPlan, inputs: ModelInputs, logits: torch.Tensor, result: StepResult
    ) -> None:
        result.stage_spans = self.link.spans().tolist()


def make_pipeline_stage(
    hidden_size: int, dtype: torch.dtype, device: torch.device
) -> PipelineStage | None:
    """This rank's stage when the model is split into stages (None: one stage)."""
    group = get_pp_group()
    if group.size <= 1:
        return None
    return PipelineStage(StageLink(group, hidden_size, dtype, device))
