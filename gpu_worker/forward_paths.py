"""How a step's forward runs: eagerly, replaying a decode graph, or as a pipeline stage.

The runner holds one `ForwardPath`, chosen when it is built: eager by default,
`GraphForward` once decode graphs are set up (CPU or CUDA), a pipeline stage's own
(stage_feature.py) under pipeline parallelism. Each is called inside the step's
`forward_context` with the model (passed at call time: the host-time bench wraps it)
and returns the normed hidden states of the logits rows [num_logits, hidden], or None
when a pipeline stage handed its activations on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from kvflow.gpu_worker.attn_metadata import AfterLayer
from kvflow.gpu_worker.input_batch import ModelInputs

if TYPE_CHECKING:  # imports Triton: only loaded where graphs are captured
    from kvflow.gpu_worker.cpu_graphs import CpuDecodeGraphs
    from kvflow.gpu_worker.cuda_graphs import DecodeGraphs


class ForwardPath(Protocol):
    def __call__(
        self, model: nn.Module, inputs: ModelInputs, after_layer: AfterLayer | None
    ) -> torch.Tensor | None: ...


def eager_forward(
    model: nn.Module, inputs: ModelInputs, after_layer: AfterLayer | None
) -> torch.Tensor:
    """[num_logits, hidden]: the last layer runs its MLP for the logits rows only."""
    rows = inputs.metadata.logits_indices
    return model(inputs.input_ids, inputs.positions, output_rows=rows)  # type: ignore[no-any-return]


class GraphForward:
    """Decode steps the graphs cover replay one; the rest (prefills, sizes past the
    largest graph, a step with a per-layer callback, which a graph cannot call) run
    eagerly."""

    def __init__(self, graphs: DecodeGraphs | CpuDecodeGraphs) -> None:
        self.graphs = graphs

    def __call__(
        self, model: nn.Module, inputs: ModelInputs, after_layer: AfterLayer | None
    ) -> torch.Tensor:
        metadata = inputs.metadata
        if after_layer is None and self.graphs.can_run(metadata):
            # [num_reqs, hidden], one token each
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, metadata)
            return hidden[metadata.logits_indices]
        return eager_forward(model, inputs, after_layer)
