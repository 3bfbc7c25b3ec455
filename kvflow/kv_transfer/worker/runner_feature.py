"""The worker half of a KV connector (connector.py) as a model-runner feature.

before_forward   start_load_kv: the blocks this step computes on top of
layer_hook       start_save_kv: each attention layer hands its blocks over
after_step       wait_for_save; the step's transfer stats into its StepResult
on_idle          a step that only waits for background loads waits a little
"""

from __future__ import annotations

import torch

from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.gpu_worker.input_batch import ModelInputs
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.kv_transfer.worker.connector import KVConnectorWorker
from kvflow.proto.step import StepPlan, StepResult

# An empty step (requests only waiting for KV pulls) waits this long for one to end,
# so that the scheduler's polling for them does not spin a core.
IDLE_LOAD_WAIT_S = 0.005


class KVConnectorFeature(StepFeature):
    def __init__(self, connector: KVConnectorWorker) -> None:
        self.connector = connector

    def before_forward(self, plan: StepPlan) -> None:
        if plan.kv_connector is not None:
            self.connector.start_load_kv(plan.kv_connector)

    def layer_hook(self, plan: StepPlan) -> AfterLayer | None:
        """A producer's saves: copied out layer by layer, during the forward."""
        if plan.kv_connector is None:
            return None
        return self.connector.start_save_kv(plan.kv_connector)

    def after_step(
        self, plan: StepPlan, inputs: ModelInputs, logits: torch.Tensor, result: StepResult
    ) -> None:
        if plan.kv_connector is not None:
            self.connector.wait_for_save(plan.kv_connector)
        result.kv_transfer = self.connector.take_stats()

    def on_idle(self, plan: StepPlan, result: StepResult) -> None:
        self.connector.wait_for_loads(IDLE_LOAD_WAIT_S)
        result.kv_transfer = self.connector.take_stats()
