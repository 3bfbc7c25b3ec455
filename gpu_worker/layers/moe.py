"""Mixture-of-experts MLP: a router picks `top_k` experts per token, and every expert's
gate|up -> SiLU*up -> down runs on its tokens in one fused call.

    x [T, H] ─router─▶ logits [T, E] ─softmax, top-k─▶ weights, ids [T, k]
                                      (or DeepSeek's grouped top-k, `GroupedTopK`)
             ─group_by_expert─▶ rows, offsets ─fused experts─▶ y [T*k, H]
             ─combine (weighted sum per token)─▶ [T, H] ─all-reduce over TP ranks─▶

The experts' weights are stacked at load from the checkpoint's per-expert tensors:
w13 [E, 2I, H] (each expert's gate rows, then its up rows) and w2 [E, H, I]. Over
tensor-parallel ranks they are split one of two ways, and either way each rank's output
is a partial sum that one all-reduce completes (as a row-parallel layer's):

    tensor parallel (default)   every rank holds every expert, I/tp of its intermediate
                                features (an MLP's Megatron split, expert by expert)
    expert parallel             rank r holds experts [r E/tp, (r+1) E/tp) whole; rows
                                routed elsewhere produce zeros here

The fused call is the native CPU kernel (kernels/cpu/fused_moe.cpp) on the CPU, the
Triton grouped GEMM (kernels/fused_moe_triton.py) on CUDA, and their torch reference
(kernels/fused_moe_reference.py) where neither applies. The CPU kernel reads the
experts packed for it: `FusedExperts.pack_for_cpu` lays out this rank's shard once
after loading (gpu_worker/weight_packing.py) and frees w13_weight and w2_weight, so the
experts are held once.

Checkpoint tensors: expert e's `<prefix>.<e>.<gate|up|down>.weight` (the family names
the prefix and the three projections: Qwen's gate_proj/up_proj/down_proj, Mixtral's
w1/w3/w2). That full name is the shard id on the stacked parameter, so a checkpoint
that lacks an expert's tensor fails at load naming it (weights.load_weights).

Options (gpt-oss), each off by default: a bias on the router; routing by a softmax over
the top-k logits alone (`topk_softmax`); biases on the experts' projections (w13_bias
[E_local, 2 I_local], w2_bias [E_local, H]; under the tensor-parallel split rank 0 holds
the down biases and the others zeros, so the all-reduce adds them once); and the clamped
SwiGLU in place of silu(gate) * up (kernels/fused_moe_reference.py states them all).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.gpu_worker.layers.linear import copy_checked, copy_checked_loader, new_parameter
from kvflow.gpu_worker.parallel_state import divide, get_tp_group
from kvflow.kernels.cpu import fused_moe as cpu_fused_moe
from kvflow.kernels.fused_moe_reference import (
    ClampedSwiGLU,
    GroupedTopK,
    Grouping,
    Routing,
    combine,
    fused_experts_reference,
    group_by_expert,
    route,
    route_grouped,
    route_topk_softmax,
)


class ExpertNames(NamedTuple):
    """How a checkpoint names one expert's projections, under `prefix.<expert>.`."""

    prefix: str  # e.g. model.layers.3.mlp.experts
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def of(self, expert: int, proj: str) -> str:
        return f"{self.prefix}.{expert}.{proj}.weight"

    def bias_of(self, expert: int, proj: str) -> str:
        return f"{self.prefix}.{expert}.{proj}.bias"


class Router(nn.Module):
    """logits = x W^T (+ b), W [E, H] replicated on every rank (`gate` in the checkpoints).

    `bias`: a router bias (gpt-oss). `float32`: W is kept and the logits computed in
    float32 whatever the model dtype, with the [E] `e_score_correction_bias` if
    `correction_bias` (DeepSeek's router, which its checkpoints and transformers keep in
    float32: a near-tie between experts must not be decided by bfloat16 rounding)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        bias: bool = False,
        float32: bool = False,
        correction_bias: bool = False,
    ) -> None:
        super().__init__()
        self.float32 = float32
        self.weight = new_parameter((num_experts, hidden_size), copy_checked_loader)
        self.bias = new_parameter((num_experts,), copy_checked_loader) if bias else None
        self.e_score_correction_bias: nn.Parameter | None = None
        if float32:
            self.weight.data = self.weight.data.float()
        if correction_bias:
            scores_bias = new_parameter((num_experts,), copy_checked_loader)
            scores_bias.data = scores_bias.data.float()
            self.e_score_correction_bias = scores_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32:
            return F.linear(x.float(), self.weight)
        return F.linear(x, self.weight, self.bias)


class FusedExperts(nn.Module):
    """This rank's experts, stacked: w13_weight [E_local, 2 I_local, H], w2_weight
    [E_local, H, I_local]; see the module docstring for the split."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        names: ExpertNames,
        bias: bool = False,
        clamped: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.num_experts, self.clamped = num_experts, clamped
        # The down biases are added once over the ranks: by rank 0 under the TP split.
        self.adds_down_bias = tp.expert_parallel or tp.rank == 0
        if tp.expert_parallel:
            self.num_local = divide(num_experts, tp.size)
            self.first_expert = tp.rank * self.num_local
            self.inter, self.inter_start = intermediate_size, 0
        else:
            self.num_local, self.first_expert = num_experts, 0
            self.inter = divide(intermediate_size, tp.size)
            self.inter_start = tp.rank * self.inter
        # checkpoint name -> (local expert, 0 gate / 1 up / 2 down)
        self.shards: dict[str, tuple[int, int]] = {}
        for local in range(self.num_local):
            for part, proj in enumerate((names.gate, names.up, names.down)):
                self.shards[names.of(self.first_expert + local, proj)] = (local, part)
        w13_ids = [name for name, (_, part) in self.shards.items() if part < 2]
        w2_ids = [name for name, (_, part) in self.shards.items() if part == 2]
        shape13 = (self.num_local, 2 * self.inter, hidden_size)
        self.w13_weight = new_parameter(shape13, self.weight_loader, w13_ids)
        shape2 = (self.num_local, hidden_size, self.inter)
        self.w2_weight = new_parameter(shape2, self.weight_loader, w2_ids)
        # Every expert's checkpoint names, this rank's or not (expert parallel skips them).
        self.all_names = {names.of(e, p) for e in range(num_experts) for p in names[1:]}
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        self.bias_shards: dict[str, tuple[int, int]] = {}  # as `shards`, of the biases
        self.packed: cpu_fused_moe.PackedExperts | None = None  # pack_for_cpu's
        if bias:
            self._add_biases(names, hidden_size)

    def _add_biases(self, names: ExpertNames, hidden_size: int) -> None:
        for local in range(self.num_local):
            for part, proj in enumerate((names.gate, names.up, names.down)):
                self.bias_shards[names.bias_of(self.first_expert + local, proj)] = (local, part)
        ids13 = [name for name, (_, part) in self.bias_shards.items() if part < 2]
        ids2 = [name for name, (_, part) in self.bias_shards.items() if part == 2]
        shape13, shape2 = (self.num_local, 2 * self.inter), (self.num_local, hidden_size)
        self.w13_bias = new_parameter(shape13, self.bias_loader, ids13)
        self.w2_bias = new_parameter(shape2, self.bias_loader, ids2)
        self.all_names |= {names.bias_of(e, p) for e in range(self.num_experts) for p in names[1:]}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        local, part = self.shards[shard_id]
        if part == 2:  # down [H, I]: this rank's intermediate columns
            copy_checked(param.data[local], loaded.narrow(1, self.inter_start, self.inter))
            return
        rows = loaded.narrow(0, self.inter_start, self.inter)  # gate or up [I, H]
        copy_checked(param.data[local].narrow(0, part * self.inter, self.inter), rows)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        local, part = self.bias_shards[shard_id]
        if part == 2:  # down [H]: whole, where this rank adds it (module docstring)
            copy_checked(
                param.data[local], loaded if self.adds_down_bias else torch.zeros_like(loaded)
            )
            return
        rows = loaded.narrow(0, self.inter_start, self.inter)  # gate or up [I]
        copy_checked(param.data[local].narrow(0, part * self.inter, self.inter), rows)

    def pack_for_cpu(self) -> bool:
        """Lay this rank's experts out for the native CPU kernel and free the plain
        weights (once, after loading); False where the kernel does not serve them."""
        w13, w2 = self.w13_weight, self.w2_weight
        if (
            self.packed is not None
            or w13.device.type != "cpu"
            or w13.dtype not in (torch.float32, torch.bfloat16)
            or not cpu_fused_moe.available()
        ):
            return False
        self.packed = cpu_fused_moe.pack(w13.data, w2.data)
        for weight in (w13, w2):  # the packed copy is the only one the forward reads
            weight.data = torch.empty(0, dtype=weight.dtype)
        return True

    def forward(self, x: torch.Tensor, routing: Routing, grouping: Grouping) -> torch.Tensor:
        """x [T, H] routed -> this rank's experts' weighted outputs per token [T, H]."""
        local = grouping.offsets[self.first_expert : self.first_expert + self.num_local + 1]
        options = cpu_fused_moe.ExpertOptions(self.w13_bias, self.w2_bias, self.clamped)
        if self.packed is not None:
            if not cpu_fused_moe.applies(x, self.packed):
                raise ValueError(f"x {x.dtype} {tuple(x.shape)} on {x.device}: experts packed")
            return cpu_fused_moe.fused_moe(x, grouping, routing, local, self.packed, options)
        w13, w2 = self.w13_weight, self.w2_weight
        if x.is_cuda:
            from kvflow.kernels.fused_moe_triton import fused_experts  # never imported on CPU

            y = fused_experts(x, grouping.rows, local, w13, w2, **options._asdict())
            return combine(y, grouping, routing)
        y = fused_experts_reference(x, grouping.rows, local, w13, w2, **options._asdict())
        return combine(y, grouping, routing)


class FusedMoE(nn.Module):
    """Router + fused experts, [T, H] -> [T, H] summed over the tensor-parallel ranks.
    `renormalize`: rescale the top-k weights to sum to 1 (Qwen's norm_topk_prob).
    `grouped`: DeepSeek's routing (GroupedTopK) instead of softmax + top-k; its router
    runs in float32, with the sigmoid scoring's correction bias. The gpt-oss options
    (module docstring): `router_bias`, `topk_softmax`, `expert_bias`, `clamped`."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        names: ExpertNames,
        grouped: GroupedTopK | None = None,
        *,
        router_bias: bool = False,
        topk_softmax: bool = False,
        expert_bias: bool = False,
        clamped: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.top_k, self.renormalize, self.grouped = top_k, renormalize, grouped
        self.topk_softmax = topk_softmax
        biased = grouped is not None and grouped.scoring == "sigmoid"
        self.gate = Router(hidden_size, num_experts, router_bias, grouped is not None, biased)
        self.experts = FusedExperts(
            num_experts, hidden_size, intermediate_size, names, expert_bias, clamped
        )

    def route(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x)
        if self.topk_softmax:
            return route_topk_softmax(logits, self.top_k)
        if self.grouped is None:
            return route(logits, self.top_k, self.renormalize)
        bias = self.gate.e_score_correction_bias
        return route_grouped(logits, self.top_k, self.renormalize, self.grouped, bias)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce."""
        routing = self.route(x)
        grouping = group_by_expert(routing.ids, self.experts.num_experts)
        return self.experts(x, routing, grouping)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))
