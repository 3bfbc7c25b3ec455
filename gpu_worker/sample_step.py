"""The end of a step: sample one token per sampled request, or verify drafts.

A step with drafts (any proposer's: the scheduler's n-gram or a draft model's) has
k_r + 1 logits rows per speculating request and goes through the rejection sampler;
any other step samples its rows. Both append the tokens to the persistent batch and
return the step's StepResult (its step_id and times are the runner's to set).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvflow.gpu_worker.input_batch import InputBatch, ModelInputs
from kvflow.gpu_worker.rejection_sampler import DraftBatch, RejectionSampler
from kvflow.gpu_worker.sampler import LogprobsTensors, Sampler
from kvflow.gpu_worker.spec_metadata import verification_metadata
from kvflow.proto.step import StepResult, TokenLogprobs

if TYPE_CHECKING:
    from kvflow.gpu_worker.draft_feature import DraftModelFeature


def sample_step(
    sampler: Sampler, batch: InputBatch, inputs: ModelInputs, logits: torch.Tensor
) -> StepResult:
    """Sample the rows of `logits` [Rs, V] fp32, one per sampled request."""
    req_ids = inputs.sample_req_ids
    if not req_ids:
        return StepResult(step_id=0, req_ids=[], sampled_token_ids=[])
    metadata = batch.sampling_metadata(inputs)
    output = sampler(logits, metadata)
    batch.append_sampled(inputs.sample_slots, output.sampled_token_ids, metadata)
    logprobs: list[list[TokenLogprobs]] = []
    if output.logprobs is not None:
        logprobs = token_logprobs(batch, output.logprobs, inputs.sample_slots.tolist())
    return StepResult(
        step_id=0,
        req_ids=req_ids,
        sampled_token_ids=[[t] for t in output.sampled_token_ids.tolist()],
        logprobs=logprobs,
    )


class Verifier:
    """Verifies a step's drafts against the target's logits (rejection_sampler.py)."""

    def __init__(self, batch: InputBatch, generator: torch.Generator) -> None:
        self.batch = batch
        # Shares the unseeded requests' generator with the sampler.
        self.rejection_sampler = RejectionSampler(generator)
        # The draft model's q (draft_model speculation); None: one-hot drafts.
        self.draft_model: DraftModelFeature | None = None

    def __call__(self, inputs: ModelInputs, logits: torch.Tensor) -> StepResult:
        """`logits` [sum(k_r + 1), V], each sampled request's k_r + 1 positions in
        order (k_r = 0 for a plain decode in the same batch)."""
        batch = self.batch
        slots = inputs.sample_slots
        slot_list = slots.tolist()
        drafts = [batch.draft_token_ids(slot) for slot in slot_list]
        verification = verification_metadata(batch.sampling, batch.rows, slots, drafts)
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=logits.device)
        q = None
        draft_probs = self.draft_model.probs if self.draft_model is not None else None
        if draft_probs and not verification.metadata.all_greedy:  # greedy: q is not needed
            q = torch.cat([draft_probs[s] for s, d in zip(slot_list, drafts) if d])
        output = self.rejection_sampler(
            logits,
            verification.metadata,
            DraftBatch([len(d) for d in drafts], flat, q),
            verification.requests.generators,
        )
        batch.append_accepted(slots, output.token_ids)
        logprobs: list[list[TokenLogprobs]] = []
        if output.logprobs is not None:
            rows = [int(s) for s, ts in zip(slot_list, output.token_ids) for _ in ts]
            flat_entries = token_logprobs(batch, output.logprobs, rows)
            start = 0
            for tokens in output.token_ids:
                entries = flat_entries[start : start + len(tokens)]
                logprobs.append([e for entry in entries for e in entry])
                start += len(tokens)
        return StepResult(
            step_id=0,
            req_ids=inputs.sample_req_ids,
            sampled_token_ids=output.token_ids,
            logprobs=logprobs,
        )


def token_logprobs(
    batch: InputBatch, tensors: LogprobsTensors, slots: list[int]
) -> list[list[TokenLogprobs]]:
    """Per sampled row: [] if that request asked for no logprobs, else its own top-N."""
    token_ids = tensors.token_ids.tolist()
    logprobs = tensors.logprobs.tolist()
    ranks = tensors.ranks.tolist()
    entries: list[list[TokenLogprobs]] = []
    for i, slot in enumerate(slots):
        num = int(batch.sampling.num_logprobs[slot])
        if num < 0:
            entries.append([])
            continue
        k = num + 1
        entries.append([TokenLogprobs(token_ids[i][:k], logprobs[i][:k], int(ranks[i]))])
    return entries
