"""M-RoPE positions of a step's tokens: a runner feature (Qwen2.5-VL).

A request whose prompt had images brings its prompt's positions [3, prompt length],
computed once where the prompt was expanded (kvflow/mrope.py), in `NewRequestData.mrope`
(again when it resumes after a preemption). Each step the feature takes, for every
scheduled token at index i of its request, column i of that table, or i + delta on all
three rows past the prompt (generated tokens); a request without images has i on all
three. So a chunk that splits an image, a prefix-cache hit and a resumed request all
read the same positions.

Where the three rows agree on every token of the step (decodes, text), M-RoPE is the
plain rotary at that one position, so the feature writes it into the step's 1-D
positions and the step may replay a decode graph. Only a step with image tokens (rows
that differ) gives the model the [3, T] table, and runs eagerly: a decode graph
replays 1-D positions.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.gpu_worker.input_batch import ModelInputs
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.mrope import positions_array
from kvflow.proto.step import StepPlan


def _eager(cache: torch.Tensor) -> None:
    """A per-layer callback that does nothing: its presence keeps the step eager."""


class MRopeFeature(StepFeature):
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._tables: dict[str, tuple[np.ndarray, int]] = {}  # req id -> ([3, N], delta)
        self._active = False
        self._flat: torch.Tensor | None = None  # the step's 1-D positions, when one row serves

    def on_plan(self, plan: StepPlan) -> None:
        self._set(None)
        for req_id in plan.finished_req_ids:
            self._tables.pop(req_id, None)
        for new in plan.new_requests:
            if new.mrope is not None:
                self._tables[new.req_id] = (positions_array(new.mrope), new.mrope.delta)

    def before_forward(self, plan: StepPlan) -> None:
        self._flat = None
        if not self._tables or not any(r in self._tables for r in plan.scheduled_req_ids):
            return
        table = self._step_table(plan)
        if (table[0] == table[1]).all() and (table[1] == table[2]).all():
            self._flat = torch.from_numpy(np.ascontiguousarray(table[0])).to(self.device)
        else:
            self._set(torch.from_numpy(table).to(self.device))

    def on_inputs(self, plan: StepPlan, inputs: ModelInputs) -> None:
        if self._flat is not None:
            inputs.positions = self._flat

    def _step_table(self, plan: StepPlan) -> np.ndarray:
        """[3, T] positions of the step's tokens, in the plan's order."""
        starts = {new.req_id: new.num_computed_tokens for new in plan.new_requests}
        starts.update((c.req_id, c.num_computed_tokens) for c in plan.cached_requests)
        parts = []
        for req_id, count in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
            index = np.arange(starts[req_id], starts[req_id] + count)  # [n]
            entry = self._tables.get(req_id)
            if entry is None:
                parts.append(np.broadcast_to(index, (3, count)))
                continue
            table, delta = entry
            inside = index < table.shape[1]
            prompt = table[:, np.minimum(index, table.shape[1] - 1)]  # [3, n]
            parts.append(np.where(inside, prompt, index + delta))
        return np.concatenate(parts, axis=1)

    def _set(self, positions: torch.Tensor | None) -> None:
        self.model.set_mrope_positions(positions)  # type: ignore[operator]
        self._active = positions is not None

    def layer_hook(self, plan: StepPlan) -> AfterLayer | None:
        return _eager if self._active else None

    def after_step(
        self, plan: StepPlan, inputs: object, logits: torch.Tensor, result: object
    ) -> None:
        self._set(None)

    def clear(self) -> None:
        self._tables.clear()
        self._set(None)
        self._flat = None


def make_mrope_feature(model: torch.nn.Module, device: torch.device) -> MRopeFeature | None:
    """The feature for an M-RoPE model (one with `set_mrope_positions`), else None."""
    return MRopeFeature(model, device) if hasattr(model, "set_mrope_positions") else None
