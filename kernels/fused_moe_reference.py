"""The fused experts' spec: routing, grouping by expert, and the expert MLPs in torch.

A mixture-of-experts layer sends each token to `top_k` of E experts. The kernels (CPU:
kernels/cpu/fused_moe.cpp, CUDA: kernels/fused_moe_triton.py) take the (token, slot)
pairs sorted by expert, so each expert's rows are one contiguous group and one call
runs every expert:

    topk_ids [T, k] ──flatten, stable sort──▶ order [T*k]: sorted row s is pair order[s]
                                              rows = order // k: its token
    counts per expert ──cumsum──▶ offsets [E+1]: expert e owns sorted rows
                                                 [offsets[e], offsets[e+1])

    T=3, k=2, E=4, topk_ids = [[2, 0], [2, 3], [0, 2]]
    pairs by expert: e0: (0,1) (2,0)  e1: -  e2: (0,0) (1,0) (2,1)  e3: (1,1)
    rows = [0, 2, 0, 1, 2, 1], offsets = [0, 2, 2, 5, 6]

Every step here has a shape fixed by (T, k, E), never by the routing: no `.item()`, no
`nonzero`, so a recorded CPU decode graph (gpu_worker/op_tape.py) replays it.

Options (gpt-oss): biases on the experts' projections (b13 [E, 2I] like w13's rows, b2
[E, H]), the clamped SwiGLU in place of silu(gate) * up (`ClampedSwiGLU`), and routing
by a softmax over the top-k logits only (`route_topk_softmax`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] float32: each chosen expert's share of the token
    ids: torch.Tensor  # [T, k] int64: the chosen experts


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over the experts, the `top_k` largest, optionally rescaled to sum to 1
    (Mixtral always; Qwen's `norm_topk_prob`). logits [T, E] -> weights, ids [T, k]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, ids)


class GroupedTopK(NamedTuple):
    """DeepSeek's routing: experts fall in `num_groups` equal groups, a token keeps its
    `topk_groups` best groups and picks its top-k experts among theirs.

        V2  softmax scores, a group scored by its best expert ("max")
        V3  sigmoid scores + e_score_correction_bias for the choice only, a group scored
            by the sum of its 2 best experts ("top2"); the weights are the bias-free scores
    Both scale the final weights by `routed_scaling_factor`."""

    scoring: str  # "softmax" or "sigmoid"
    group_score: str  # "max" or "top2"
    num_groups: int = 1  # 1: plain top-k over every expert (V2's "greedy")
    topk_groups: int = 1
    scaling: float = 1.0


def route_grouped(
    logits: torch.Tensor,  # [T, E] float32
    top_k: int,
    renormalize: bool,
    spec: GroupedTopK,
    correction_bias: torch.Tensor | None = None,  # [E] float32 (V3)
) -> Routing:
    """GroupedTopK's routing (its docstring); shapes fixed by (T, E, k) as route's."""
    if spec.scoring == "sigmoid":
        scores = logits.float().sigmoid()
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    choice = scores if correction_bias is None else scores + correction_bias
    if spec.num_groups > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, spec.num_groups, num_experts // spec.num_groups)
        if spec.group_score == "top2":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.amax(dim=-1)
        kept = torch.topk(group_scores, spec.topk_groups, dim=-1).indices  # [T, topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep[:, :, None], -torch.inf).view(num_tokens, num_experts)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(weights * spec.scaling, ids)


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> Routing:
    """The `top_k` largest logits, then a softmax over those alone (gpt-oss): the weights
    sum to 1. logits [T, E] -> weights, ids [T, k]."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return Routing(torch.softmax(top, dim=-1, dtype=torch.float32), ids)


class ClampedSwiGLU(NamedTuple):
    """gpt-oss's expert activation: with gate clamped to (-inf, limit] and up to
    [-limit, limit], act = (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0


def expert_activation(
    gate: torch.Tensor, up: torch.Tensor, clamped: ClampedSwiGLU | None = None
) -> torch.Tensor:
    """silu(gate) * up, or the clamped SwiGLU; in the inputs' dtype, op by op."""
    if clamped is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=clamped.limit)
    up = up.clamp(min=-clamped.limit, max=clamped.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * clamped.alpha))


class Grouping(NamedTuple):
    order: torch.Tensor  # [T*k] int64: the flat (token, slot) pair of each sorted row
    rows: torch.Tensor  # [T*k] int64: the token of each sorted row
    offsets: torch.Tensor  # [E+1] int64: expert e's sorted rows [offsets[e], offsets[e+1])
    inverse: torch.Tensor  # [T*k] int64: the sorted row of each flat pair


def group_by_expert(ids: torch.Tensor, num_experts: int) -> Grouping:
    """The pairs of `ids` [T, k] sorted by expert (stable: token order within an expert)."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=ids.device)
    return Grouping(order, order // ids.shape[1], offsets, inverse)


def fused_experts_reference(
    x: torch.Tensor,  # [T, H]
    rows: torch.Tensor,  # [N] int64: token of each sorted row
    offsets: torch.Tensor,  # [E+1] int64: the experts' sorted rows (absolute indices)
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    *,
    b13: torch.Tensor | None = None,  # [E, 2I]: gate biases, then up biases
    b2: torch.Tensor | None = None,  # [E, H]
    clamped: ClampedSwiGLU | None = None,
) -> torch.Tensor:  # [N, H]: rows outside [offsets[0], offsets[E]) are zero
    """silu(x w_gate^T) * (x w_up^T) w_down^T per expert on its rows, in x's dtype
    (with the biases and activation given: see the module docstring)."""
    y = x.new_zeros(rows.shape[0], x.shape[1])
    # int() of each (not tolist()): a CPU graph's recording sees the data-dependent read
    # and runs the step eagerly rather than freezing this routing into its tape.
    bounds = [int(bound) for bound in offsets]
    for e in range(w13.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        bias13 = None if b13 is None else b13[e]
        gate, up = F.linear(x[rows[start:end]], w13[e], bias13).chunk(2, dim=-1)
        act = expert_activation(gate, up, clamped)
        y[start:end] = F.linear(act, w2[e], None if b2 is None else b2[e])
    return y


def combine(y: torch.Tensor, grouping: Grouping, routing: Routing) -> torch.Tensor:
    """The sorted rows' outputs y [T*k, H] weighted and summed per token -> [T, H]."""
    num_tokens, top_k = routing.ids.shape
    pairs = y[grouping.inverse]  # back to (token, slot) order
    weights = routing.weights.to(y.dtype).view(num_tokens, 1, top_k)
    return torch.bmm(weights, pairs.view(num_tokens, top_k, -1)).squeeze(1)
