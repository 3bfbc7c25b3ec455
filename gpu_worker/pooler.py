"""The pooling runner's end of a step: hidden states -> one vector per finished prompt.

A pooling request only prefills, in one step or in chunks over several. The step that
computes its last prompt token returns its vector (`StepResult.pooled`, float32 bytes)
in place of a sampled token; no logits are computed and nothing is sampled::

    request r scheduled n tokens from position c (query rows q0 .. q0+n-1 of the step)
    LAST   the last layer's output at the prompt's last token (row q0+n-1 of its last chunk)
    MEAN   sum over every chunk's rows, kept per request between chunks, / prompt length
    CLS    the row of position 0 (its first chunk), kept until the last chunk

MEAN and CLS need the hidden state of position 0 on: the scheduler gives them no
prefix-cache hit (services/scheduler/pooling.py), and a request whose first chunk
starts past 0 with nothing accumulated is an error here, never a wrong vector. A
request the plan tells the worker to forget (finished, aborted, preempted) drops what
was accumulated: a preempted one recomputes from position 0.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.gpu_worker.input_batch import ModelInputs
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.pooling import PoolingSpec
from kvflow.proto.step import StepPlan, StepResult


class PoolingFeature(StepFeature):
    def __init__(self, spec: PoolingSpec) -> None:
        self.spec = spec
        # MEAN: the sum of the rows so far; CLS: position 0's row. float32 [hidden].
        self._partial: dict[str, torch.Tensor] = {}

    def on_plan(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self._partial.pop(req_id, None)

    def clear(self) -> None:
        self._partial.clear()

    def forward(
        self, model: nn.Module, inputs: ModelInputs, after_layer: AfterLayer | None
    ) -> torch.Tensor:
        """The runner's forward path: the last layer's rows the pooler reads (LAST: the
        finished prompts' last rows, as for sampling; MEAN: all; CLS: position 0's)."""
        rows: torch.Tensor | None = inputs.metadata.logits_indices
        if self.spec.pooling_type == "MEAN":
            rows = None
        elif self.spec.pooling_type == "CLS":
            first = [q for q, start in zip(_query_starts(inputs), _starts(inputs)) if start == 0]
            rows = torch.tensor(first, dtype=torch.int64, device=inputs.input_ids.device)
        return model(inputs.input_ids, inputs.positions, output_rows=rows)  # type: ignore[no-any-return]

    def pool(self, plan: StepPlan, inputs: ModelInputs, hidden: torch.Tensor) -> StepResult:
        """The step's result: a vector for each request whose prompt ends here."""
        hidden = hidden.float()
        if self.spec.pooling_type == "LAST":
            finished = hidden  # [Rs, hidden], the sampled rows in order
        else:
            per_request = self._per_request(plan, inputs, hidden)
            finished = self._finish(plan, inputs, per_request)
        if self.spec.normalize and len(finished):
            finished = torch.nn.functional.normalize(finished, dim=-1)
        vectors = finished.cpu().numpy()
        return StepResult(
            step_id=0,
            req_ids=inputs.sample_req_ids,
            sampled_token_ids=[[] for _ in inputs.sample_req_ids],
            pooled=[vector.astype("<f4").tobytes() for vector in vectors],
        )

    def _per_request(
        self, plan: StepPlan, inputs: ModelInputs, hidden: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Fold this step's rows into each request's partial result."""
        starts = _starts(inputs)
        if self.spec.pooling_type == "MEAN":
            counts = torch.tensor(plan.num_scheduled_tokens, device=hidden.device)
            owner = torch.repeat_interleave(torch.arange(len(counts), device=hidden.device), counts)
            step_rows = torch.zeros(len(counts), hidden.shape[1], device=hidden.device)
            step_rows.index_add_(0, owner, hidden)  # [R, hidden]: each chunk's sum
        else:  # CLS: one row per request that starts at position 0, in plan order
            step_rows = hidden
        index = 0
        for req_id, start in zip(plan.scheduled_req_ids, starts):
            partial = self._partial.get(req_id)
            if partial is None and start != 0:
                raise RuntimeError(
                    f"{self.spec.pooling_type} pooling of request {req_id} starts at position "
                    f"{start}: its earlier hidden states were never computed (prefix-cache hit?)"
                )
            if self.spec.pooling_type == "MEAN":
                row = step_rows[index]
                self._partial[req_id] = row if partial is None else partial + row
                index += 1
            elif start == 0:
                self._partial[req_id] = step_rows[index]
                index += 1
        return self._partial

    def _finish(
        self, plan: StepPlan, inputs: ModelInputs, partial: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """[Rs, hidden]: the finished requests' vectors (MEAN divides by the length)."""
        if not inputs.sample_req_ids:
            return torch.zeros(0, self.spec.hidden_size)
        # A finished prompt's sequence length is its length.
        lengths = dict(zip(plan.scheduled_req_ids, inputs.metadata.seq_lens_cpu))
        rows = []
        for req_id in inputs.sample_req_ids:
            row = partial.pop(req_id)
            rows.append(row / lengths[req_id] if self.spec.pooling_type == "MEAN" else row)
        return torch.stack(rows)


def _query_starts(inputs: ModelInputs) -> list[int]:
    return inputs.metadata.query_start_loc_cpu[:-1]


def _starts(inputs: ModelInputs) -> list[int]:
    """The first position each request computes this step (seq_len - scheduled)."""
    metadata = inputs.metadata
    qsl = metadata.query_start_loc_cpu
    return [seq - (qsl[i + 1] - qsl[i]) for i, seq in enumerate(metadata.seq_lens_cpu)]
