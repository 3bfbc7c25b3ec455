"""Speculative decoding's verification: keep the longest run of draft tokens consistent
with the target model, so that the emitted tokens are distributed exactly as if the
target had sampled them one by one.

Request r brings k_r draft tokens d_0..d_{k-1} (k_r may be 0) and the target's logits at
k_r + 1 positions (after the context, after d_0, ..., after d_{k-1})::

    position j        0      1     ...   k-1      k
    target dist      p_0    p_1          p_{k-1}  p_k       (target_probs.py, per position,
    draft            d_0    d_1          d_{k-1}             penalties see d_<j)

    accept d_j with probability a_j = min(1, p_j(d_j) / q_j(d_j)), in order;
    at the first rejection emit a token drawn from normalize(max(0, p_j - q_j));
    if all k are accepted emit a bonus token drawn from p_k.

q_j is the draft's distribution; n-gram and suffix drafts are deterministic, so q_j is
one-hot at d_j (a_j = p_j(d_j), and the residual is p_j without d_j). Greedy rows are
the special case where p_j is one-hot at the argmax: accept while d_j == argmax.

One uniform per emitted token: at position j, u_j decides acceptance (u_j < a_j), and on
rejection (u_j - a_j) / (1 - a_j), uniform on [0, 1) given u_j >= a_j, draws the
residual by inverse CDF. So a seeded request consumes exactly one draw of its generator
per emitted token, the contract `request_generator` replays after a preemption.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvflow.gpu_worker.sampler import LogprobsTensors, apply_logits_processors, gather_logprobs
from kvflow.gpu_worker.sampling_metadata import SamplingMetadata
from kvflow.gpu_worker.target_probs import target_probs
from kvflow.gpu_worker.vocab_ops import row_argmax, sample_from_weights


@dataclass(frozen=True, eq=False)
class DraftBatch:
    """The drafts of R requests. Row r of the target's logits block is
    offsets[r] + j for j in 0..k_r; drafts are flattened in the same request order."""

    num_draft_tokens: list[int]  # [R] k_r >= 0
    draft_token_ids: torch.Tensor  # [sum k] int64
    draft_probs: torch.Tensor | None  # [sum k, V] q; None: one-hot (n-gram, suffix)

    @property
    def num_requests(self) -> int:
        return len(self.num_draft_tokens)


class RejectionOutput(NamedTuple):
    token_ids: list[list[int]]  # per request: accepted drafts + 1 (recovered or bonus)
    num_accepted: list[int]  # per request: drafts accepted
    logprobs: LogprobsTensors | None  # one row per emitted token, in request order


class RejectionSampler:
    """Unseeded requests share `generator` (the global RNG when None); a seeded request
    draws from its own generator in `generators` (keyed by request index)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,  # [sum(k_r + 1), V] fp32, consumed
        metadata: SamplingMetadata,  # one row per position (spec_metadata.py)
        drafts: DraftBatch,
        generators: dict[int, torch.Generator],  # seeded random requests only
    ) -> RejectionOutput:
        raw = None
        if metadata.max_num_logprobs is not None:
            raw = logits.log_softmax(dim=1)  # raw logprobs, as the Sampler reports
        layout = _Layout.build(drafts.num_draft_tokens, logits.device)
        states: dict[int, torch.Tensor] = {}
        if metadata.all_greedy and drafts.draft_probs is None:
            num_accepted, final = _greedy(logits, metadata, drafts, layout)
        else:
            probs = target_probs(logits, metadata)  # [N, V]
            uniforms, states = self._uniforms(layout, generators, logits.device)
            accept = accept_probs(probs, drafts, layout.draft_rows)  # [sum k]
            accepted = uniforms.index_select(0, layout.draft_rows) < accept  # [sum k]
            num_accepted = _leading_accepted(accepted, layout)  # [R]
            final = _final_tokens(probs, drafts, layout, uniforms, accept, num_accepted)
        num_accepted_list = num_accepted.tolist()  # the host syncs
        final_list = final.tolist()
        _settle(generators, states, num_accepted_list)
        draft_lists = _split(drafts.draft_token_ids.tolist(), drafts.num_draft_tokens)
        tokens = [[*ds[:n], t] for ds, n, t in zip(draft_lists, num_accepted_list, final_list)]
        logprobs = None
        if raw is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = _emitted_logprobs(raw, layout, tokens, metadata.max_num_logprobs)
        return RejectionOutput(tokens, num_accepted_list, logprobs)

    def _uniforms(
        self, layout: _Layout, generators: dict[int, torch.Generator], device: torch.device
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One U[0, 1) per position, and each seeded generator's state before its draws."""
        uniforms = torch.rand(layout.num_rows, generator=self.generator, device=device)  # [N]
        states = {}
        for r, generator in generators.items():
            states[r] = generator.get_state()
            start, count = layout.offsets[r], layout.num_draft_tokens[r] + 1
            # One call per draw: CUDA's philox offsets count calls, and `_settle` replays
            # the same calls.
            draws = [torch.rand(1, generator=generator, device=device) for _ in range(count)]
            uniforms[start : start + count] = torch.cat(draws)
        return uniforms, states


@dataclass(frozen=True, eq=False)
class _Layout:
    """Where each request's positions and drafts sit in the flat tensors."""

    num_draft_tokens: list[int]  # [R]
    offsets: list[int]  # [R] first target row of each request
    num_rows: int  # sum(k_r + 1)
    k: torch.Tensor  # [R] int64
    row_offsets: torch.Tensor  # [R] int64, `offsets` on the device
    draft_offsets: torch.Tensor  # [R] int64, first draft of each request in the flat list
    draft_rows: torch.Tensor  # [sum k] target row of each draft: offsets[r] + j
    draft_requests: torch.Tensor  # [sum k] request index of each draft
    draft_positions: torch.Tensor  # [sum k] j

    @classmethod
    def build(cls, num_draft_tokens: list[int], device: torch.device) -> _Layout:
        offsets: list[int] = []
        draft_offsets: list[int] = []
        rows: list[int] = []
        requests: list[int] = []
        positions: list[int] = []
        row = draft = 0
        for r, k in enumerate(num_draft_tokens):
            offsets.append(row)
            draft_offsets.append(draft)
            rows.extend(range(row, row + k))
            requests.extend([r] * k)
            positions.extend(range(k))
            row += k + 1
            draft += k

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            num_draft_tokens=list(num_draft_tokens),
            offsets=offsets,
            num_rows=row,
            k=ints(list(num_draft_tokens)),
            row_offsets=ints(offsets),
            draft_offsets=ints(draft_offsets),
            draft_rows=ints(rows),
            draft_requests=ints(requests),
            draft_positions=ints(positions),
        )


def accept_probs(probs: torch.Tensor, drafts: DraftBatch, draft_rows: torch.Tensor) -> torch.Tensor:
    """[sum k] a_j = min(1, p_j(d_j) / q_j(d_j)); q one-hot gives p_j(d_j)."""
    d = drafts.draft_token_ids.unsqueeze(1)  # [sum k, 1]
    p = probs.index_select(0, draft_rows).gather(1, d).squeeze(1)
    if drafts.draft_probs is None:
        return p
    q = drafts.draft_probs.gather(1, d).squeeze(1)
    return (p / q.clamp_min(torch.finfo(torch.float32).tiny)).clamp_max(1.0)


def residual_weights(
    p: torch.Tensor,  # [R, V] the target at each request's first rejected position
    q: torch.Tensor | None,  # [R, V] the draft there; None: one-hot at `draft`
    draft: torch.Tensor,  # [R] the rejected draft token
) -> torch.Tensor:  # [R, V] max(0, p - q), not normalised
    if q is None:
        return p.scatter(1, draft.unsqueeze(1), 0.0)
    return (p - q).clamp_min(0.0)


def _greedy(
    logits: torch.Tensor, md: SamplingMetadata, drafts: DraftBatch, layout: _Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """All rows greedy and one-hot drafts: accept while the draft is the argmax, then
    the argmax; no [N, V] probabilities and no randomness (as the Sampler's greedy)."""
    apply_logits_processors(logits, md)
    targets = row_argmax(logits)  # [N]
    accepted = targets.index_select(0, layout.draft_rows) == drafts.draft_token_ids
    num_accepted = _leading_accepted(accepted, layout)  # [R]
    return num_accepted, targets.index_select(0, layout.row_offsets + num_accepted)


def _leading_accepted(accepted: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """[R] per request, how many drafts are accepted before the first rejection."""
    first_reject = torch.where(
        accepted, layout.k.index_select(0, layout.draft_requests), layout.draft_positions
    )
    return layout.k.clone().scatter_reduce_(0, layout.draft_requests, first_reject, reduce="amin")


def _final_tokens(
    probs: torch.Tensor,  # [N, V]
    drafts: DraftBatch,
    layout: _Layout,
    uniforms: torch.Tensor,  # [N]
    accept: torch.Tensor,  # [sum k]
    num_accepted: torch.Tensor,  # [R]
) -> torch.Tensor:  # [R] the token after the accepted run: recovered or bonus
    rows = layout.row_offsets + num_accepted  # [R]
    p = probs.index_select(0, rows)  # [R, V]
    u = uniforms.index_select(0, rows)  # [R]
    rejected = num_accepted < layout.k  # [R]
    if drafts.draft_token_ids.numel() == 0:
        return sample_from_weights(p, u)
    # The rejected draft of each request (clamped for requests with none rejected).
    last = drafts.draft_token_ids.numel() - 1
    index = (layout.draft_offsets + num_accepted).clamp_max(last)  # [R]
    q = None if drafts.draft_probs is None else drafts.draft_probs.index_select(0, index)
    residual = residual_weights(p, q, drafts.draft_token_ids.index_select(0, index))
    a = accept.index_select(0, index)
    # Given u >= a, (u - a) / (1 - a) is uniform on [0, 1): the draw is reused.
    rescaled = ((u - a) / (1.0 - a).clamp_min(1e-12)).clamp(0.0, 1.0 - 1e-7)
    weights = torch.where(rejected.unsqueeze(1), residual, p)
    return sample_from_weights(weights, torch.where(rejected, rescaled, u))


def _settle(
    generators: dict[int, torch.Generator],
    states: dict[int, torch.Tensor],
    num_accepted: list[int],
) -> None:
    """Leave each seeded generator exactly num_accepted + 1 draws past its start."""
    for r, generator in generators.items():
        generator.set_state(states[r])
        for _ in range(num_accepted[r] + 1):
            torch.rand(1, generator=generator, device=generator.device)


def _split(flat: list[int], counts: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for count in counts:
        out.append(flat[start : start + count])
        start += count
    return out


def _emitted_logprobs(
    raw: torch.Tensor, layout: _Layout, tokens: list[list[int]], k: int
) -> LogprobsTensors:
    rows = [o + j for o, ts in zip(layout.offsets, tokens) for j in range(len(ts))]
    index = torch.tensor(rows, dtype=torch.int64, device=raw.device)
    flat = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64, device=raw.device)
    return gather_logprobs(raw.index_select(0, index), flat, k)
