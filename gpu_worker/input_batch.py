"""The worker's persistent batch: per-request state kept across steps.

Only deltas arrive in a `StepPlan`; this module applies them and turns the plan into
the flat tensors one forward pass needs (token ids, positions, slot mapping, block
tables). Tokens the worker samples are appended here, so they never travel back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.gpu_worker.sampling_metadata import request_generator
from kvflow.proto.step import StepPlan
from kvflow.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs, including the last sampled token
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class PromptLogprobsRange:
    """Rows of hidden states whose logits give prompt logprobs for prompt[start+1 : end+1]."""

    req_id: str
    start: int  # index into the prompt-logprob list (position of the predicting token)
    end: int
    first_row: int  # row in the flat token batch of position `start`


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_req_ids: list[str]  # requests sampled this step, rows of logits_indices[:n]
    prompt_ranges: list[PromptLogprobsRange] = field(default_factory=list)


class InputBatch:
    def __init__(self, block_size: int, device: torch.device, seed: int = 0) -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self.seed = seed

    def apply_plan(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in plan.new_requests:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                num_drawn = len(new.token_ids) - new.num_prompt_tokens  # > 0 if resumed
                generator = request_generator(params.seed, self.device, num_drawn)
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
            )
        for cached in plan.cached_requests:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def prepare_inputs(self, plan: StepPlan) -> ModelInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_req_ids: list[str] = []
        prompt_ranges: list[PromptLogprobsRange] = []
        for req_id, num_tokens in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens):
            state = self.requests[req_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            first_row = len(input_ids)
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            prompt_range = _prompt_logprobs_range(state, start, end, first_row)
            if prompt_range is not None:
                prompt_ranges.append(prompt_range)
            if end == len(state.token_ids):
                logits_rows.append(len(input_ids) - 1)
                sample_req_ids.append(req_id)
        for prompt_range in prompt_ranges:
            num_rows = prompt_range.end - prompt_range.start
            logits_rows.extend(range(prompt_range.first_row, prompt_range.first_row + num_rows))
        metadata = self._build_metadata(plan, positions, query_start_loc, seq_lens, logits_rows)
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=metadata.slot_mapping.new_tensor(positions),
            metadata=metadata,
            sample_req_ids=sample_req_ids,
            prompt_ranges=prompt_ranges,
        )

    def _build_metadata(
        self,
        plan: StepPlan,
        positions: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        logits_rows: list[int],
    ) -> AttentionMetadata:
        block_lists = [self.requests[r].block_ids for r in plan.scheduled_req_ids]
        max_blocks = max(len(b) for b in block_lists)
        block_tables = torch.tensor(
            [b + [0] * (max_blocks - len(b)) for b in block_lists], dtype=torch.int32
        )  # [num_reqs, max_blocks]
        num_tokens_per_req = torch.tensor(plan.num_scheduled_tokens)
        req_index = torch.repeat_interleave(torch.arange(len(block_lists)), num_tokens_per_req)
        pos = torch.tensor(positions, dtype=torch.int64)
        block_size = self.block_size
        slot_mapping = block_tables[req_index, pos // block_size].long() * block_size + (
            pos % block_size
        )  # [num_tokens]
        device = self.device
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            max_query_len=max(plan.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        )

    def append_sampled(self, req_ids: list[str], token_ids: list[int]) -> None:
        for req_id, token_id in zip(req_ids, token_ids):
            self.requests[req_id].token_ids.append(token_id)


def _prompt_logprobs_range(
    state: RequestState, start: int, end: int, first_row: int
) -> PromptLogprobsRange | None:
    """Prompt logprobs are computed once, before the request has produced output."""
    if state.sampling_params.prompt_logprobs is None:
        return None
    if len(state.token_ids) != state.num_prompt_tokens:
        return None  # resumed after preemption: they were already sent
    last = min(end, state.num_prompt_tokens - 1)  # the last prompt token predicts nothing
    if start >= last:
        return None
    return PromptLogprobsRange(state.req_id, start, last, first_row)
