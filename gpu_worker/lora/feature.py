"""The runner's LoRA feature: each step's row -> adapter slot mapping, and the forward
that applies it.

    on_plan         remember each new request's adapter, forget the finished ones
    before_forward  the step's distinct adapters into slots (manager.py); one slot per
                    scheduled token (-1: the base) into the shared LoraBatch
    forward         a step without adapters, as before; a decode step with adapters
                    replays (or records) a CPU decode graph of the adapted forward
                    when the graphs take LoRA (`replay_lora`); any other step with
                    adapters runs eagerly with the mapping

Speculative decoding's verification rows are tokens like any other; a draft model
(its own forward, outside this path) runs without the adapter.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.gpu_worker.forward_paths import ForwardPath
from kvflow.gpu_worker.input_batch import ModelInputs
from kvflow.gpu_worker.lora.manager import LoraManager
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.proto.lora import LoRARequest
from kvflow.proto.step import StepPlan


class LoraFeature(StepFeature):
    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager
        self.batch = manager.batch
        self._adapter_of: dict[str, LoRARequest] = {}

    def on_plan(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self._adapter_of.pop(req_id, None)
        for new in plan.new_requests:
            if new.lora_request is not None:
                self._adapter_of[new.req_id] = new.lora_request

    def before_forward(self, plan: StepPlan) -> None:
        adapters = [self._adapter_of.get(r) for r in plan.scheduled_req_ids]
        used = [a for a in adapters if a is not None]
        if not used:
            self.batch.clear()
            return
        slot_of = self.manager.slots_for(used)
        req_slots = np.fromiter(
            (-1 if a is None else slot_of[a.lora_int_id] for a in adapters),
            dtype=np.int64,
            count=len(adapters),
        )
        self.batch.set(np.repeat(req_slots, plan.num_scheduled_tokens))

    def clear(self) -> None:
        self._adapter_of.clear()
        self.batch.clear()

    def forward_path(self, inner: ForwardPath, replay_lora: bool = False) -> ForwardPath:
        """`inner` for steps without adapters, and for decode steps with adapters where
        `replay_lora` (inner replays CPU decode graphs keyed by the batch's variant);
        the LoRA eager forward for the others."""

        def forward(
            model: nn.Module, inputs: ModelInputs, after_layer: AfterLayer | None
        ) -> torch.Tensor | None:
            if not self.batch.active or (
                replay_lora and inputs.metadata.is_decode_only and self.batch.replayable
            ):
                return inner(model, inputs, after_layer)
            rows = inputs.metadata.logits_indices
            if len(rows) == self.batch.num_tokens:  # every row: one mapping serves all
                hidden = model(inputs.input_ids, inputs.positions)
                return hidden[rows]  # type: ignore[no-any-return]
            self.batch.set_output_rows(rows)
            return model(inputs.input_ids, inputs.positions, output_rows=rows)  # type: ignore[no-any-return]

        return forward
