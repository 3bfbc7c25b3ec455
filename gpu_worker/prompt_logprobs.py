"""Prompt logprobs as a runner feature: a prefill chunk of a request that asked for
them has logits rows for its prompt tokens too (after the sampled rows); each row
gives the logprob of the next prompt token and the top-k.

Registered on every runner: any request may ask; a step without prompt ranges costs
one empty loop.
"""

from __future__ import annotations

import torch

from kvflow.gpu_worker.input_batch import InputBatch, ModelInputs
from kvflow.gpu_worker.sampler import LogprobsTensors, compute_prompt_logprobs
from kvflow.gpu_worker.step_features import StepFeature
from kvflow.proto.step import StepPlan, StepResult, TokenLogprobs


class PromptLogprobsFeature(StepFeature):
    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch

    def after_step(
        self, plan: StepPlan, inputs: ModelInputs, logits: torch.Tensor, result: StepResult
    ) -> None:
        """Rows num_sample_rows.. of `logits` [num_logits, V]: each range's, in order."""
        if not inputs.prompt_ranges:
            return
        row = inputs.num_sample_rows
        for prompt_range in inputs.prompt_ranges:
            params = self.batch.sampling.params[prompt_range.slot]
            assert params is not None
            k = params.prompt_logprobs or 0
            num_rows = prompt_range.end - prompt_range.start
            next_ids = self.batch.prompt_token_ids(
                prompt_range.slot, prompt_range.start + 1, prompt_range.end + 1
            )
            tensors = compute_prompt_logprobs(logits[row : row + num_rows], next_ids, k)
            req_id = prompt_range.req_id
            result.prompt_logprobs[req_id] = _rows_to_token_logprobs(tensors, num_rows, k)
            result.prompt_logprobs_start[req_id] = prompt_range.start
            row += num_rows


def _rows_to_token_logprobs(tensors: LogprobsTensors, num_rows: int, k: int) -> list[TokenLogprobs]:
    token_ids = tensors.token_ids.tolist()
    logprobs = tensors.logprobs.tolist()
    ranks = tensors.ranks.tolist()
    return [
        TokenLogprobs(token_ids[i][: k + 1], logprobs[i][: k + 1], int(ranks[i]))
        for i in range(num_rows)
    ]
