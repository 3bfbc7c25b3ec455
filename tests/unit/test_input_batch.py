"""The worker's persistent batch: slots, deltas, inputs gathered from preallocated rows,
per-slot sampling state and incremental penalty counts, checked against from-scratch
computations over the requests' own histories."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvflow.gpu_worker.input_batch import BatchLimits, InputBatch
from kvflow.gpu_worker.sampler import Sampler, apply_logits_processors
from kvflow.gpu_worker.sampling_metadata import SamplingMetadata, request_generator
from kvflow.proto.step import CachedRequestData, NewRequestData, StepPlan
from kvflow.sampling_params import SamplingParams as SP

B = 4  # block size
V = 40  # vocabulary
EOS = 0
CPU = torch.device("cpu")


def new_batch(max_num_seqs: int = 4, max_model_len: int = 64) -> InputBatch:
    return InputBatch(BatchLimits(max_num_seqs, max_model_len, B), V, {EOS}, CPU)


def new_data(
    req_id: str,
    tokens: Sequence[int],
    blocks: list[int],
    params: SP | None = None,
    *,
    num_prompt: int | None = None,
    computed: int = 0,
) -> NewRequestData:
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    return NewRequestData(req_id, list(tokens), num_prompt, params or SP(), blocks, computed)


def plan(
    scheduled: dict[str, int],
    new: Sequence[NewRequestData] = (),
    cached: Sequence[CachedRequestData] = (),
    finished: Sequence[str] = (),
) -> StepPlan:
    return StepPlan(
        0, list(new), list(cached), list(scheduled), list(scheduled.values()), list(finished)
    )


# ---- inputs -----------------------------------------------------------------------------


def test_mixed_step_inputs_are_exact() -> None:
    """attn_metadata's picture: r0 decodes, r1 runs a prefill chunk, r2 starts a prefill."""
    batch = new_batch()
    r0, r1 = new_data("r0", range(10, 16), [5, 2]), new_data("r1", range(20, 28), [7, 9])
    batch.apply_plan(plan({"r0": 6}, new=[r0, r1]))
    batch.append_sampled(np.array([0]), torch.tensor([16]), _metadata(batch, [0]))
    step = plan(
        {"r0": 1, "r1": 3, "r2": 2},
        new=[new_data("r2", [30, 31, 32], [4])],
        cached=[CachedRequestData("r0", [], 6), CachedRequestData("r1", [], 4)],
    )
    batch.apply_plan(step)
    inputs = batch.prepare_inputs(step)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [16, 24, 25, 26, 30, 31]
    assert inputs.positions.tolist() == [6, 4, 5, 6, 0, 1]
    # r0: position 6 in block 2 -> 2*4+2; r1: 4..6 in block 9; r2: 0..1 in block 4
    assert md.slot_mapping.tolist() == [10, 36, 37, 38, 16, 17]
    assert md.query_start_loc.tolist() == [0, 1, 4, 6]
    assert md.seq_lens.tolist() == [7, 7, 2]
    assert md.query_start_loc_cpu == [0, 1, 4, 6] and md.seq_lens_cpu == [7, 7, 2]
    assert md.block_tables.tolist() == [[5, 2], [7, 9], [4, 0]]
    assert (md.max_query_len, md.max_seq_len) == (3, 7)
    # Only r0 is sampled: r1's chunk and r2's prefill stop short of their last token.
    assert inputs.sample_req_ids == ["r0"] and md.logits_indices.tolist() == [0]
    assert inputs.sample_slots.tolist() == [0]
    assert inputs.input_ids.dtype == inputs.positions.dtype == md.slot_mapping.dtype == torch.int64


def test_decode_only_step_and_appended_blocks() -> None:
    batch = new_batch()
    batch.apply_plan(
        plan(
            {"a": 3, "b": 4}, new=[new_data("a", [1, 2, 3], [8]), new_data("b", [4, 5, 6, 7], [3])]
        )
    )
    inputs = batch.prepare_inputs(plan({"a": 3, "b": 4}))
    assert inputs.sample_req_ids == ["a", "b"] and inputs.metadata.logits_indices.tolist() == [2, 6]
    batch.append_sampled(inputs.sample_slots, torch.tensor([11, 12]), _metadata(batch, [0, 1]))
    # b's fifth token needs a second block: only the new block id travels.
    step = plan(
        {"b": 1, "a": 1}, cached=[CachedRequestData("b", [6], 4), CachedRequestData("a", [], 3)]
    )
    batch.apply_plan(step)
    inputs = batch.prepare_inputs(step)
    md = inputs.metadata
    assert inputs.input_ids.tolist() == [12, 11] and inputs.positions.tolist() == [4, 3]
    assert md.slot_mapping.tolist() == [6 * B + 0, 8 * B + 3]
    assert md.block_tables.tolist() == [[3, 6], [8, 0]]
    assert md.seq_lens.tolist() == [5, 4] and md.query_start_loc.tolist() == [0, 1, 2]
    assert inputs.sample_req_ids == ["b", "a"] and inputs.sample_slots.tolist() == [1, 0]


def test_async_step_computes_at_the_token_the_worker_sampled() -> None:
    """Depth 2: the next plan is made before the sample is back; the worker's own copy
    already holds the token, so the decode step reads it."""
    batch = new_batch()
    first = plan({"a": 2}, new=[new_data("a", [5, 6], [1])])
    batch.apply_plan(first)
    inputs = batch.prepare_inputs(first)
    batch.append_sampled(inputs.sample_slots, torch.tensor([33]), _metadata(batch, [0]))
    second = plan({"a": 1}, cached=[CachedRequestData("a", [], 2)])
    batch.apply_plan(second)
    assert batch.prepare_inputs(second).input_ids.tolist() == [33]


def test_forced_tokens_are_computed_after_the_sample_and_sampled_after() -> None:
    """Jump-forward: the plan's forced tokens follow the worker's own last sample; the
    step computes sample + forced as one chunk and samples after the last of them."""
    batch = new_batch()
    first = plan({"a": 2}, new=[new_data("a", [5, 6], [1], SP(frequency_penalty=1.0))])
    batch.apply_plan(first)
    inputs = batch.prepare_inputs(first)
    batch.append_sampled(inputs.sample_slots, torch.tensor([33]), _metadata(batch, [0]))
    second = plan({"a": 3}, cached=[CachedRequestData("a", [2], 2)])
    second.forced_token_ids = {"a": [34, 34]}
    batch.apply_plan(second)
    inputs = batch.prepare_inputs(second)
    assert inputs.input_ids.tolist() == [33, 34, 34] and inputs.positions.tolist() == [2, 3, 4]
    assert inputs.sample_req_ids == ["a"] and inputs.metadata.logits_indices.tolist() == [2]
    counts = batch.sampling.penalties.counts
    assert counts is not None and counts[0, 34] == 2  # forced tokens are outputs too


# ---- slots ------------------------------------------------------------------------------


def test_freed_slots_are_reused_lowest_first_without_leftovers() -> None:
    batch = new_batch(max_num_seqs=3)
    penalised = SP(frequency_penalty=1.0, logit_bias={3: 2.0}, min_tokens=2, seed=5)
    b = new_data("b", [2] * 5, [2, 12], penalised)
    batch.apply_plan(plan({}, new=[new_data("a", [1], [1]), b, new_data("c", [3], [3])]))
    assert [batch.slot_of[r] for r in "abc"] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        batch.add(new_data("x", [1], [4]))
    batch.apply_plan(plan({}, new=[new_data("d", [9, 8], [5])], finished=["b", "a"]))
    assert batch.slot_of == {"c": 2, "d": 0} and batch.num_requests == 2
    batch.apply_plan(plan({}, new=[new_data("e", [7], [6])]))
    assert batch.slot_of["e"] == 1  # b's old slot: nothing of b's state is inherited
    md = _metadata(batch, [1])
    assert md.penalties is None and md.logit_bias is None and md.banned is None
    assert md.generators == {} and md.no_penalties
    assert batch.block_table[1].tolist()[:2] == [6, 0] and batch.num_tokens[1] == 1


def test_a_new_occupant_never_reuses_the_slots_cached_parameters() -> None:
    batch = new_batch()
    batch.apply_plan(plan({}, new=[new_data("a", [1], [1], SP(temperature=0.0))]))
    assert _metadata(batch, [0]).all_greedy
    assert _metadata(batch, [0]) is _metadata(batch, [0])  # same composition: reused
    batch.apply_plan(plan({}, new=[new_data("b", [1], [1], SP(seed=4))], finished=["a"]))
    md = _metadata(batch, [0])
    assert not md.all_greedy and list(md.generators) == [0]
    # The same request resumed in the same slot gets a fresh (replayed) generator.
    resumed = new_data("b", [1, 5], [1], SP(seed=4), num_prompt=1)
    batch.apply_plan(plan({}, new=[resumed], finished=["b"]))
    assert _metadata(batch, [0]).generators[0] is batch.sampling.generators[0]
    assert batch.sampling.generators[0] is not md.generators[0]


def test_preempted_request_resumes_with_its_outputs_and_no_prompt_logprobs() -> None:
    batch = new_batch()
    params = SP(seed=11, prompt_logprobs=2, presence_penalty=0.5)
    start = plan({"a": 3}, new=[new_data("a", [4, 5, 6], [2], params)])
    batch.apply_plan(start)
    inputs = batch.prepare_inputs(start)
    assert [(r.start, r.end) for r in inputs.prompt_ranges] == [(0, 2)]
    assert inputs.metadata.logits_indices.tolist() == [2, 0, 1]  # sample row, then prompt rows
    # Preempted after two outputs; resumed later as a new request with prompt + outputs.
    resumed = new_data("a", [4, 5, 6, 9, 9], [7, 1], params, num_prompt=3)
    step = plan({"a": 5}, new=[resumed], finished=["a"])
    batch.apply_plan(step)
    inputs = batch.prepare_inputs(step)
    assert inputs.prompt_ranges == [] and inputs.metadata.logits_indices.tolist() == [4]
    assert inputs.input_ids.tolist() == [4, 5, 6, 9, 9]
    slot = batch.slot_of["a"]
    assert batch.sampling.penalties.counts is not None
    assert (
        batch.sampling.penalties.counts[slot, 9] == 2
        and batch.sampling.penalties.counts[slot].sum() == 2
    )
    # Its generator replays the two draws its outputs took.
    generator = batch.sampling.generators[slot]
    assert generator is not None
    want = request_generator(11, CPU, num_drawn=2)
    assert torch.rand(3, generator=generator).tolist() == torch.rand(3, generator=want).tolist()


# ---- sampling state over many steps -----------------------------------------------------


@dataclass
class _Req:
    prompt: list[int]
    params: SP
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class Driver:
    """Plays the scheduler (whole-prompt prefills, then one token per step) and the
    model (random logits) around a real InputBatch and Sampler, like ModelRunner."""

    def __init__(self, max_num_seqs: int = 4) -> None:
        self.batch = new_batch(max_num_seqs)
        self.sampler = Sampler(torch.Generator().manual_seed(0))
        self.noise = torch.Generator().manual_seed(1)
        self.reqs: dict[str, _Req] = {}
        self.new: list[NewRequestData] = []
        self.finished: list[str] = []
        self.next_block = 1
        # The last step's logits per sampled request, before and after bias/bans/penalties.
        self.raw: dict[str, torch.Tensor] = {}
        self.processed: dict[str, torch.Tensor] = {}

    def add(self, req_id: str, prompt: list[int], params: SP) -> None:
        self.reqs[req_id] = _Req(prompt, params)
        self._send_new(req_id)

    def preempt(self, req_id: str) -> None:
        """Forget it on the worker and send it again in full (prompt + outputs)."""
        req = self.reqs[req_id]
        req.computed, req.blocks = 0, []
        self.finished.append(req_id)
        self._send_new(req_id)

    def finish(self, req_id: str) -> None:
        del self.reqs[req_id]
        self.finished.append(req_id)

    def _send_new(self, req_id: str) -> None:
        req = self.reqs[req_id]
        data = new_data(
            req_id, req.tokens, self._blocks(req), req.params, num_prompt=len(req.prompt)
        )
        self.new.append(data)

    def _blocks(self, req: _Req) -> list[int]:
        needed = -(-(len(req.tokens)) // B) - len(req.blocks)
        new = list(range(self.next_block, self.next_block + needed))
        self.next_block += needed
        req.blocks += new
        return new

    def step(self) -> None:
        new_ids = {n.req_id for n in self.new}
        cached = [
            CachedRequestData(r, self._blocks(req), req.computed)
            for r, req in self.reqs.items()
            if r not in new_ids
        ]
        scheduled = {r: len(req.tokens) - req.computed for r, req in self.reqs.items()}
        step = plan(scheduled, self.new, cached, self.finished)
        self.new, self.finished = [], []
        self.batch.apply_plan(step)
        inputs = self.batch.prepare_inputs(step)
        logits = torch.randn(len(inputs.sample_req_ids), V, generator=self.noise) * 2
        md = self.batch.sampling_metadata(inputs)
        processed = logits.clone()
        apply_logits_processors(processed, md)
        self.metadata = md
        self.raw = dict(zip(inputs.sample_req_ids, logits.clone()))
        self.processed = dict(zip(inputs.sample_req_ids, processed))
        sampled = self.sampler(logits, md).sampled_token_ids
        self.batch.append_sampled(inputs.sample_slots, sampled, md)
        for req_id, token in zip(inputs.sample_req_ids, sampled.tolist()):
            req = self.reqs[req_id]
            req.computed = len(req.tokens)
            req.outputs.append(token)


def _metadata(batch: InputBatch, slots: list[int]) -> SamplingMetadata:
    return batch.sampling.metadata(np.array(slots, dtype=np.int64), batch.rows)


def dense_reference(logits: torch.Tensor, req: _Req, history: list[int]) -> torch.Tensor:
    """The penalties over the whole vocabulary, from scratch: bias and bans first, as
    the sampler orders them, are not used by these requests."""
    p = req.params
    counts = torch.bincount(
        torch.tensor(history[len(req.prompt) :], dtype=torch.int64), minlength=V
    ).float()
    prompt_mask = torch.bincount(torch.tensor(req.prompt), minlength=V) > 0
    seen = (counts > 0) | prompt_mask
    x = logits.clone()
    x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


PENALISED = {
    "freq": SP(frequency_penalty=0.7, temperature=1.0),
    "rep": SP(repetition_penalty=1.7, temperature=1.0),
    "all": SP(presence_penalty=0.4, frequency_penalty=-0.3, repetition_penalty=0.8, top_k=9),
}


def test_penalty_counts_equal_a_count_from_scratch_after_many_steps() -> None:
    driver = Driver(max_num_seqs=5)
    driver.add("plain", [1, 2, 3], SP(temperature=1.0))
    driver.add("freq", [5, 5, 6], PENALISED["freq"])
    driver.add("rep", [7, 8, 9, 10, 11, 12, 13], PENALISED["rep"])
    driver.add("all", [14], PENALISED["all"])
    for step in range(14):
        if step == 5:
            driver.preempt("rep")  # its counts are rebuilt from the outputs sent again
        if step == 8:
            driver.finish("plain")
            driver.add("late", [2, 2], SP(frequency_penalty=2.0, temperature=1.0))  # slot 0 again
        histories = {r: req.tokens for r, req in driver.reqs.items()}
        driver.step()
        counts = driver.batch.sampling.penalties.counts
        assert counts is not None
        for req_id, req in driver.reqs.items():
            raw, processed = driver.raw[req_id], driver.processed[req_id]
            if req_id == "plain":
                assert torch.equal(processed, raw)
                continue
            want = torch.bincount(torch.tensor(req.outputs), minlength=V).float()
            assert torch.equal(counts[driver.batch.slot_of[req_id]], want), (step, req_id)
            assert torch.equal(processed, dense_reference(raw, req, histories[req_id])), (
                step,
                req_id,
            )
    outputs = [t for req in driver.reqs.values() for t in req.outputs]
    assert len(outputs) > len(set(outputs))  # repeats happened: frequency counts above 1


def test_no_penalty_state_without_penalised_requests() -> None:
    driver = Driver()
    driver.add("a", [1, 2], SP(temperature=1.0, min_tokens=2, logit_bias={4: 1.0}))
    driver.add("b", [3], SP(temperature=0.0, seed=3))
    for _ in range(4):
        driver.step()
    assert driver.batch.sampling.penalties.counts is None
    md = _metadata(driver.batch, [0, 1])
    assert md.penalties is None and md.no_penalties


def test_min_tokens_bans_lift_exactly_at_min_tokens() -> None:
    driver = Driver()
    likely_stop = {EOS: 100.0, 7: 100.0}
    driver.add("a", [1, 2], SP(min_tokens=3, stop_token_ids=[7], logit_bias=likely_stop))
    for step in range(5):
        driver.step()
        banned = driver.metadata.banned
        if step < 3:
            assert banned is not None and banned.token_ids.tolist() == [EOS, 7]
        else:
            assert banned is None
    outputs = driver.reqs["a"].outputs
    assert not {EOS, 7} & set(outputs[:3]) and set(outputs[3:]) <= {EOS, 7}
