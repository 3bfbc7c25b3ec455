"""Guided decoding as a runner feature: a step whose plan carries a grammar bitmask
masks its sampled rows before sampling (grammar_bitmask.py does the masking).

Registered on every runner: any request may be guided; a plan without a bitmask
costs one attribute check.
"""

from __future__ import annotations

import torch

from kvflow.gpu_worker.grammar_bitmask import apply_grammar_bitmask
from kvflow.gpu_worker.input_batch import ModelInputs
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.proto.step import StepPlan


class GrammarFeature(StepFeature):
    def on_logits(self, plan: StepPlan, inputs: ModelInputs, logits: torch.Tensor) -> None:
        if plan.grammar_bitmask is None:
            return
        # Guided requests never carry drafts: one row each, but a speculating request
        # beside them has several, so map rows to requests.
        apply_grammar_bitmask(logits, inputs.sample_row_req_ids(), plan.grammar_bitmask)
