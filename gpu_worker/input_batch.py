"""The worker's persistent batch: each running request's state in preallocated rows.

A request gets a *slot* when it arrives (`NewRequestData`, sent once, and again only
when it resumes after a preemption) and keeps it until the plan tells the worker to
forget it; a freed slot is reused, lowest first. Per slot, in host memory::

    token_ids    [slots, max_model_len] int32   prompt + outputs (incl. the last sample)
    num_tokens, num_prompt_tokens, num_computed_tokens   [slots] int64
    block_tables [groups, slots, max_blocks_per_req] int32, 0 past num_blocks: one table
                 per KV cache group (kvflow/kv_groups.py; -1 = a block out of the window)
    sampling     per-slot sampling parameters and penalty counts (sampling_state.py)

Later plans carry only deltas (`CachedRequestData`: appended block ids, tokens computed
before the step), and the tokens the worker samples are written into `token_ids` here,
so they never travel back (with steps in flight, the next plan already computes at
their positions). Pipeline stages before the last never sample: the plan gives them
the sampled tokens they compute from (`new_token_ids`, written at their positions). A step's inputs are gathered from these arrays with index arithmetic,
never built token by token::

    request r with slot s, scheduled n tokens from position c = num_computed[s]:
    positions      c, c+1, ..., c+n-1
    input_ids      token_ids[s, positions]
    slot_mapping   block_table[s, positions // B] * B + positions % B
    seq_lens       c + n;  sampled when c + n == num_tokens[s] (the end of what is known)

Speculative decoding: a plan's draft tokens for slot s are written past its known
tokens, token_ids[s, num_tokens : num_tokens + k] (num_drafts[s] = k, for this step
only), so they are gathered as inputs like any other token. Such a request is sampled
when c + n reaches num_tokens + k, and its last k + 1 positions give logits rows (the
target after the context and after each draft); the tokens it accepts are appended.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.gpu_worker.attn_metadata import AttentionMetadata
from kvflow.gpu_worker.sampling_metadata import SamplingMetadata
from kvflow.gpu_worker.sampling_state import SamplingState, TokenRows
from kvflow.proto.step import CachedRequestData, NewRequestData, StepPlan


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int  # slots
    max_model_len: int  # tokens per slot
    block_size: int
    num_kv_groups: int = 1  # block tables per request (kvflow/kv_groups.py)

    @property
    def max_blocks_per_req(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)


@dataclass
class PromptLogprobsRange:
    """Rows of hidden states whose logits give prompt logprobs for prompt[start+1 : end+1]."""

    req_id: str
    slot: int
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
    sample_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # [Rs] drafts of each sampled request: it has num_drafts + 1 logits rows, in order.
    sample_num_drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_sample_rows(self) -> int:
        return len(self.sample_req_ids) + int(self.sample_num_drafts.sum())

    def sample_row_req_ids(self) -> list[str]:
        """The request of each sampled logits row: a request with k drafts has k + 1
        consecutive rows (one per draft position, then the bonus)."""
        if not self.sample_num_drafts.any():
            return self.sample_req_ids
        repeats = (self.sample_num_drafts + 1).tolist()
        return [r for r, n in zip(self.sample_req_ids, repeats) for _ in range(n)]


class InputBatch:
    def __init__(
        self,
        limits: BatchLimits,
        vocab_size: int,
        eos_token_ids: set[int],
        device: torch.device,
    ) -> None:
        self.limits = limits
        self.device = device
        slots = limits.max_num_seqs
        self.token_ids = torch.zeros(slots, limits.max_model_len, dtype=torch.int32)
        self._token_ids = self.token_ids.numpy()  # the same memory
        self.num_tokens = np.zeros(slots, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(slots, dtype=np.int64)
        self.num_computed_tokens = np.zeros(slots, dtype=np.int64)
        self.num_drafts = np.zeros(slots, dtype=np.int64)  # this step's draft tokens
        groups = limits.num_kv_groups
        self.block_tables = np.zeros((groups, slots, limits.max_blocks_per_req), dtype=np.int32)
        self.group_num_blocks = np.zeros((groups, slots), dtype=np.int64)
        self.block_table = self.block_tables[0]  # group 0's (views)
        self.num_blocks = self.group_num_blocks[0]
        self.sampling = SamplingState(slots, vocab_size, eos_token_ids, device)
        self.slot_of: dict[str, int] = {}
        self.req_ids: list[str | None] = [None] * slots
        self._free_slots = list(range(slots))  # a heap: the lowest free slot first
        self._prompt_logprobs: set[int] = set()  # slots whose prompt logprobs are due
        self.rows = TokenRows(self.token_ids, self.num_tokens, self.num_prompt_tokens)

    @property
    def num_requests(self) -> int:
        return len(self.slot_of)

    # ---- plan deltas -------------------------------------------------------------------

    def apply_plan(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self.remove(req_id)
        for new in plan.new_requests:
            self.add(new)
        for cached in plan.cached_requests:
            self._update(cached)
        for req_id, forced in plan.forced_token_ids.items():  # before drafts: they go after
            self.append_accepted(np.array([self.slot_of[req_id]]), [forced])
        self.num_drafts[:] = 0
        for req_id, drafts in plan.spec_token_ids.items():
            self._put_drafts(self.slot_of[req_id], drafts)

    def _put_drafts(self, slot: int, drafts: list[int]) -> None:
        start = int(self.num_tokens[slot])
        if start + len(drafts) > self.limits.max_model_len:
            raise ValueError(f"slot {slot}: drafts past max_model_len")
        self._token_ids[slot, start : start + len(drafts)] = drafts
        self.num_drafts[slot] = len(drafts)

    def draft_token_ids(self, slot: int) -> list[int]:
        start = int(self.num_tokens[slot])
        return self._token_ids[slot, start : start + int(self.num_drafts[slot])].tolist()

    def add(self, new: NewRequestData) -> int:
        """Put a new (or resumed) request into the lowest free slot."""
        assert new.req_id not in self.slot_of, f"{new.req_id} arrived twice"
        if not self._free_slots:
            raise RuntimeError(f"more than max_num_seqs={self.limits.max_num_seqs} requests")
        num_tokens = len(new.token_ids)
        if num_tokens > self.limits.max_model_len:
            raise ValueError(f"{new.req_id}: {num_tokens} tokens > max_model_len")
        slot = heapq.heappop(self._free_slots)
        self.slot_of[new.req_id] = slot
        self.req_ids[slot] = new.req_id
        self._token_ids[slot, :num_tokens] = new.token_ids
        self.num_tokens[slot] = num_tokens
        self.num_prompt_tokens[slot] = new.num_prompt_tokens
        self.num_computed_tokens[slot] = new.num_computed_tokens
        self.block_tables[:, slot] = 0
        self.group_num_blocks[:, slot] = 0
        self._append_blocks(slot, new.block_ids)
        for group, block_ids in enumerate(new.group_block_ids, start=1):
            self._append_blocks(slot, block_ids, group)
        params = new.sampling_params
        outputs = self.token_ids[slot, new.num_prompt_tokens : num_tokens]
        self.sampling.add(slot, params, outputs)
        # Prompt logprobs are due once, before any output: not again on a resume.
        if params.prompt_logprobs is not None and num_tokens == new.num_prompt_tokens:
            self._prompt_logprobs.add(slot)
        return slot

    def remove(self, req_id: str) -> None:
        """Forget a finished, aborted or preempted request and free its slot."""
        slot = self.slot_of.pop(req_id, None)
        if slot is None:
            return
        self.req_ids[slot] = None
        self.sampling.remove(slot)
        self._prompt_logprobs.discard(slot)
        heapq.heappush(self._free_slots, slot)

    def clear(self) -> None:
        for req_id in list(self.slot_of):
            self.remove(req_id)

    def _update(self, cached: CachedRequestData) -> None:
        slot = self.slot_of[cached.req_id]
        if cached.new_block_ids:
            self._append_blocks(slot, cached.new_block_ids)
        for group, block_ids in enumerate(cached.new_group_block_ids, start=1):
            self._append_blocks(slot, block_ids, group)
        self.num_computed_tokens[slot] = cached.num_computed_tokens
        if cached.new_token_ids:  # pipeline stages that did not sample them
            start = cached.num_computed_tokens
            end = start + len(cached.new_token_ids)
            self._token_ids[slot, start:end] = cached.new_token_ids
            self.num_tokens[slot] = max(int(self.num_tokens[slot]), end)

    def _append_blocks(self, slot: int, block_ids: list[int], group: int = 0) -> None:
        start = int(self.group_num_blocks[group, slot])
        end = start + len(block_ids)
        if end > self.limits.max_blocks_per_req:
            raise ValueError(f"slot {slot}: {end} blocks > {self.limits.max_blocks_per_req}")
        self.block_tables[group, slot, start:end] = block_ids
        self.group_num_blocks[group, slot] = end

    # ---- one step's inputs -------------------------------------------------------------

    def prepare_inputs(self, plan: StepPlan) -> ModelInputs:
        """The forward's inputs for the scheduled requests, in the plan's order."""
        slots = np.fromiter(
            (self.slot_of[r] for r in plan.scheduled_req_ids),
            dtype=np.int64,
            count=len(plan.scheduled_req_ids),
        )  # [R]
        num_scheduled = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)  # [R]
        start = self.num_computed_tokens[slots]  # [R]
        seq_lens = start + num_scheduled  # [R]
        query_start_loc = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        token_slots, positions = self._token_positions(slots, start, num_scheduled, query_start_loc)
        input_ids = self._token_ids[token_slots, positions].astype(np.int64)  # [T]
        known = self.num_tokens[slots] + self.num_drafts[slots]  # [R]
        sampled = np.flatnonzero(seq_lens == known)  # [Rs] batch rows
        num_drafts = self.num_drafts[slots[sampled]]  # [Rs]
        prompt_ranges = self._prompt_logprobs_ranges(slots, start, seq_lens, query_start_loc)
        logits_rows = [_last_rows(query_start_loc[sampled + 1], num_drafts + 1)]
        logits_rows += [
            np.arange(p.first_row, p.first_row + p.end - p.start) for p in prompt_ranges
        ]
        metadata = self._attention_metadata(
            slots, token_slots, positions, seq_lens, query_start_loc, np.concatenate(logits_rows)
        )
        return ModelInputs(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            metadata=metadata,
            sample_req_ids=[plan.scheduled_req_ids[i] for i in sampled.tolist()],
            prompt_ranges=prompt_ranges,
            sample_slots=slots[sampled],
            sample_num_drafts=num_drafts,
        )

    def span_inputs(
        self, slots: np.ndarray, start: np.ndarray, num_new: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of a forward over tokens start..start+n-1 of
        each slot in `slots` [R] (its block table as it stands), with one logits row per
        request at its last token. The draft model's forwards use it (gpu_worker/drafter.py):
        they run over spans the plan did not schedule."""
        query_start_loc = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        token_slots, positions = self._token_positions(slots, start, num_new, query_start_loc)
        input_ids = self._token_ids[token_slots, positions].astype(np.int64)
        metadata = self._attention_metadata(
            slots, token_slots, positions, start + num_new, query_start_loc, query_start_loc[1:] - 1
        )
        return self._to_device(input_ids), self._to_device(positions), metadata

    def _token_positions(
        self,
        slots: np.ndarray,
        start: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(slot, position) [T] of every scheduled token, requests one after another."""
        if query_start_loc[-1] == len(slots):  # decode only: one token per request
            return slots, start
        token_req = np.repeat(np.arange(len(slots)), num_scheduled)  # [T]
        offset_in_req = np.arange(query_start_loc[-1]) - query_start_loc[token_req]
        return slots[token_req], start[token_req] + offset_in_req

    def _attention_metadata(
        self,
        slots: np.ndarray,
        token_slots: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        logits_rows: np.ndarray,
    ) -> AttentionMetadata:
        slot_mapping, block_tables = self._group_tables(0, slots, token_slots, positions)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=self._to_device(query_start_loc.astype(np.int32)),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_tables=block_tables,
            max_query_len=int((query_start_loc[1:] - query_start_loc[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            logits_indices=self._to_device(logits_rows.astype(np.int64)),
        )
        for group in range(1, self.limits.num_kv_groups):  # the same step, its own tables
            slot_mapping, block_tables = self._group_tables(group, slots, token_slots, positions)
            metadata.group_metadata.append(
                dataclasses.replace(
                    metadata,
                    slot_mapping=slot_mapping,
                    block_tables=block_tables,
                    group_metadata=[],
                )
            )
        return metadata

    def _group_tables(
        self, group: int, slots: np.ndarray, token_slots: np.ndarray, positions: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping [T] int64, block_tables [R, max_blocks] int32) of one KV group."""
        block_size = self.limits.block_size
        table = self.block_tables[group]
        blocks = table[token_slots, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size  # [T]
        max_blocks = int(self.group_num_blocks[group, slots].max())
        return self._to_device(slot_mapping), self._to_device(table[slots, :max_blocks])

    def _prompt_logprobs_ranges(
        self,
        slots: np.ndarray,
        start: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
    ) -> list[PromptLogprobsRange]:
        """Prompt logprobs are computed once, before the request has produced output;
        the last prompt token predicts nothing."""
        ranges: list[PromptLogprobsRange] = []
        if not self._prompt_logprobs:
            return ranges
        for row, slot in enumerate(slots.tolist()):
            if slot not in self._prompt_logprobs:
                continue
            last = min(int(seq_lens[row]), int(self.num_prompt_tokens[slot]) - 1)
            if start[row] < last:
                req_id = self.req_ids[slot]
                assert req_id is not None
                first_row = int(query_start_loc[row])
                ranges.append(PromptLogprobsRange(req_id, slot, int(start[row]), last, first_row))
        return ranges

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    # ---- sampling ----------------------------------------------------------------------

    def sampling_metadata(self, inputs: ModelInputs) -> SamplingMetadata:
        return self.sampling.metadata(inputs.sample_slots, self.rows)

    def append_sampled(
        self, slots: np.ndarray, sampled: torch.Tensor, metadata: SamplingMetadata
    ) -> None:
        """Write the tokens sampled for `slots` ([R] int64, on the device) into the rows."""
        self.sampling.record_sampled(metadata, sampled)
        if self.num_tokens[slots].max(initial=0) >= self.limits.max_model_len:
            raise ValueError("a request sampled past max_model_len")
        self._token_ids[slots, self.num_tokens[slots]] = sampled.cpu().numpy()
        self.num_tokens[slots] += 1
        if self._prompt_logprobs:  # a request with output owes no prompt logprobs
            self._prompt_logprobs.difference_update(slots.tolist())

    def append_accepted(self, slots: np.ndarray, token_ids: list[list[int]]) -> None:
        """Speculative steps: write each slot's emitted tokens (1..k+1) into its row and
        count them for penalties; the drafts past them are simply overwritten later.
        Also a plan's grammar-forced tokens (jump-forward), which count the same way."""
        counts = self.sampling.penalties.counts
        for slot, tokens in zip(slots.tolist(), token_ids):
            start = int(self.num_tokens[slot])
            if start + len(tokens) > self.limits.max_model_len:
                raise ValueError("a request sampled past max_model_len")
            self._token_ids[slot, start : start + len(tokens)] = tokens
            self.num_tokens[slot] = start + len(tokens)
            if self.sampling.penalties.active[slot]:
                assert counts is not None
                ids = torch.tensor(tokens, dtype=torch.int64, device=counts.device)
                counts[slot].index_add_(0, ids, torch.ones(len(tokens), device=counts.device))
        if self._prompt_logprobs:
            self._prompt_logprobs.difference_update(slots.tolist())

    def prompt_token_ids(self, slot: int, start: int, end: int) -> torch.Tensor:
        return self.token_ids[slot, start:end].to(self.device, torch.int64)


def _last_rows(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The last counts[i] rows before ends[i] for each i, in order: [sum(counts)]."""
    if counts.size == 0 or int(counts.max()) == 1:
        return ends - 1
    firsts = np.repeat(ends - counts, counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return firsts + np.arange(int(counts.sum())) - starts
