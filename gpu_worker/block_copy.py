"""Copy-on-write of KV blocks as a runner feature: a plan's `kv_block_copies` are made
in every layer's cache (and the draft model's, which shares the block ids) before the
batch takes the plan, so the forward that first writes a copy reads it whole.

Beam search forks a beam by sharing its parent's full blocks and copying only the
partially filled last one (services/scheduler/beam_feature.py); a step's copies go as
one batched index copy per cache tensor, K and V together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvflow.gpu_worker.step_features import StepFeature
from kvflow.proto.step import StepPlan


class BlockCopyFeature(StepFeature):
    def __init__(self, caches: Callable[[], list[torch.Tensor]], device: torch.device) -> None:
        self.caches = caches  # each [2, num_blocks, block_size, kv_heads, row_width]
        self.device = device

    def on_plan(self, plan: StepPlan) -> None:
        if not plan.kv_block_copies:
            return
        pairs = torch.tensor(plan.kv_block_copies, dtype=torch.long).to(self.device)  # [C, 2]
        src, dst = pairs[:, 0], pairs[:, 1]
        for cache in self.caches():
            cache.index_copy_(1, dst, cache.index_select(1, src))
