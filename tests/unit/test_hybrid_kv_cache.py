"""The hybrid KV cache's bookkeeping: group layouts, sliding-window groups releasing
blocks as a request grows past the window (counted in free blocks), chunked prefill,
prefix hits a sliding group agrees on, preemption, the group tables on the wire and in
the worker's persistent batch. `check_integrity()` after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvflow.errors import PromptTooLongError
from kvflow.gpu_worker.input_batch import BatchLimits, InputBatch
from kvflow.gpu_worker.kv_layout import stage_slots
from kvflow.kv_groups import max_blocks_held, plan_kv_groups, single_group
from kvflow.proto.step import CachedRequestData, NewRequestData, StepPlan
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.admission import EngineLimits, check_lengths
from kvflow.services.scheduler.kv_cache_manager import NULL_BLOCK, KVCacheManager

B = 4  # block size
W = 8  # sliding window: the query at p reads p - 7 .. p


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_int_id: int = 0
    image_spans: list[tuple[int, int, str]] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)


def gemma3_1b_windows() -> list[int | None]:
    return [None if i % 6 == 5 else 1024 for i in range(26)]


def test_gemma3_layout_groups_the_global_layers_and_cuts_the_local_ones() -> None:
    layout = plan_kv_groups(gemma3_1b_windows())
    assert layout.windows == (None, 1024, 1024, 1024, 1024, 1024, 1024)
    assert layout.num_slots == 4  # one block id = 4 layers' K/V
    assert [i for i, g in enumerate(layout.layer_groups) if g == 0] == [5, 11, 17, 23]
    assert [layout.layer_slots[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert layout.layer_groups[24:] == (6, 6) and layout.layer_slots[24:] == (0, 1)
    assert layout.wire_windows == [0, 1024, 1024, 1024, 1024, 1024, 1024]


def test_one_kind_of_layers_or_hybrid_off_is_one_group() -> None:
    assert plan_kv_groups([None] * 3) == single_group(3)
    assert plan_kv_groups(gemma3_1b_windows(), hybrid=False) == single_group(26)
    mistral = plan_kv_groups([4096] * 3)  # one group that still drops blocks
    assert mistral.windows == (4096,) and mistral.num_slots == 3 and mistral.is_hybrid
    assert not single_group(3).is_hybrid


def manager(num_blocks: int = 64, windows: tuple[int | None, ...] = (None, W)) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, enable_prefix_caching=True, group_windows=windows)


def step(mgr: KVCacheManager, req: Req, num_new: int) -> None:
    """Allocate for `num_new` tokens, check, then count them computed (as a step does)."""
    first = req.request_id not in mgr.groups[0].tables
    assert mgr.allocate_slots(req, num_new) is not None
    mgr.check_integrity()
    req.num_computed_tokens += num_new
    if first:
        req.tables = [mgr.get_block_ids(req.request_id), *mgr.get_group_block_ids(req.request_id)]


def held(mgr: KVCacheManager, req: Req, group: int) -> int:
    return sum(1 for b in mgr.groups[group].tables[req.request_id] if b != NULL_BLOCK)


@pytest.mark.parametrize("chunk", [1, 3, 6])
def test_a_sliding_group_releases_blocks_that_left_the_window(chunk: int) -> None:
    """Decode (chunk 1) or chunked prefill: the sliding group holds only the blocks from
    the one of position computed - W + 1 on (plus this step's), the full group all."""
    mgr = manager()
    req = Req("r", list(range(60)))
    while req.num_computed_tokens + chunk <= 60:
        before = req.num_computed_tokens
        step(mgr, req, chunk)
        end = before + chunk
        num_blocks = -(-end // B)
        sliding = num_blocks - max(0, before - W + 1) // B
        assert held(mgr, req, 0) == num_blocks
        assert held(mgr, req, 1) == sliding
        assert mgr.num_free_blocks == 64 - num_blocks - sliding  # counted, not inferred
    assert held(mgr, req, 1) <= W // B + 1 + -(-chunk // B)  # the window, not the context
    mgr.free("r")
    mgr.check_integrity()
    assert mgr.num_free_blocks == 64


def test_released_entries_are_null_and_never_sent_twice() -> None:
    mgr = manager()
    req = Req("r", list(range(40)))
    step(mgr, req, 16)  # blocks 0-3 in both groups, sent whole (NewRequestData)
    assert req.tables[1] == mgr.groups[1].tables["r"]
    assert mgr.take_new_group_block_ids("r") == []
    step(mgr, req, 4)  # from 16: keys from 9 on -> block 0 and 1 released
    assert mgr.groups[1].tables["r"][:2] == [NULL_BLOCK, NULL_BLOCK]
    [appended] = mgr.take_new_group_block_ids("r")
    assert appended == mgr.groups[1].tables["r"][4:]  # only the new block travels


def test_prefix_hit_of_a_sliding_group_needs_only_the_window_blocks() -> None:
    mgr = manager()
    first = Req("a", list(range(30)))
    step(mgr, first, 30)  # 7 full blocks hashed in both groups
    mgr.free("a")
    second = Req("b", [*range(30), 99, 98])
    computed = mgr.get_computed_blocks(second)
    assert computed.num_computed_tokens == 28  # 7 blocks agreed by both groups
    [sliding] = computed.group_block_ids
    # The query at 28 reads keys 21.. -> blocks 5 and 6; blocks 0-4 are not needed.
    assert sliding[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in sliding[5:]
    assert NULL_BLOCK not in computed.block_ids and len(computed.block_ids) == 7
    assert mgr.prefix_cache_hits == 28
    second.num_computed_tokens = 28
    assert mgr.allocate_slots(second, 4, computed) is not None
    mgr.check_integrity()
    assert held(mgr, second, 1) == 2 + 1  # the window's two hit blocks + one new


def test_a_hit_shrinks_until_the_sliding_window_is_cached() -> None:
    """The full group would hit 7 blocks, but the sliding group lost block 5 of its
    window: the hit moves back to a point whose window it holds (blocks 3, 4 -> 5)."""
    mgr = manager()
    step(mgr, Req("a", list(range(30))), 30)
    mgr.free("a")
    hashes = mgr._block_hashes(Req("probe", list(range(30))))
    mgr.free("probe")
    victim = mgr.block_pool.get_cached_block(mgr.groups[1].key(hashes[5]))
    assert victim is not None
    mgr.block_pool.uncache(victim)  # as if evicted
    computed = mgr.get_computed_blocks(Req("b", [*range(30), 7]))
    assert computed.num_computed_tokens == 5 * B
    [sliding] = computed.group_block_ids  # the query at 20 reads keys 13.. -> blocks 3, 4
    assert sliding[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in sliding[3:]
    assert len(computed.block_ids) == 5


def test_preemption_frees_every_group_with_null_entries() -> None:
    mgr = manager(num_blocks=12)
    req = Req("r", list(range(40)))
    step(mgr, req, 16)
    step(mgr, req, 4)  # sliding releases blocks 0, 1
    assert mgr.allocate_slots(req, 16) is None  # 4 + 5 more blocks per group do not fit
    mgr.check_integrity()
    mgr.free("r", step_discarded=True)
    mgr.check_integrity()
    assert mgr.num_free_blocks == 12


def test_one_group_sends_no_group_tables() -> None:
    mgr = manager(windows=(None,))
    req = Req("r", list(range(20)))
    step(mgr, req, 20)
    assert mgr.get_group_block_ids("r") == [] and mgr.take_new_group_block_ids("r") == []
    assert mgr.num_free_blocks == 64 - 5


# ---- the worker's side ---------------------------------------------------------------


def test_the_persistent_batch_keeps_a_table_per_group() -> None:
    """Group 1's table arrives whole with -1 before the window, then by deltas; its step
    metadata maps the new tokens to its own blocks, group 0's to its own."""
    batch = InputBatch(BatchLimits(2, 64, B, num_kv_groups=2), 40, {0}, torch.device("cpu"))
    tokens = list(range(1, 23))  # 22 tokens, 20 computed (a prefix hit) + 2 to compute
    new = NewRequestData(
        "r", tokens, 22, SamplingParams(), [0, 1, 2, 3, 4, 5], 20,
        group_block_ids=[[NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 13, 14, 15]],
    )  # fmt: skip
    batch.apply_plan(StepPlan(0, [new], [], ["r"], [2]))
    md = batch.prepare_inputs(StepPlan(1, [], [], ["r"], [2])).metadata
    assert md.slot_mapping.tolist() == [5 * B, 5 * B + 1]
    [group] = md.group_metadata
    assert group.slot_mapping.tolist() == [15 * B, 15 * B + 1]
    assert group.block_tables.tolist() == [[-1, -1, -1, 13, 14, 15]]
    assert group.seq_lens is md.seq_lens and md.of_group(1) is group
    cached = CachedRequestData("r", [6], 22, new_group_block_ids=[[16]])
    batch.apply_plan(StepPlan(2, [], [cached], ["r"], [3]))
    batch.num_tokens[0] = 25
    md = batch.prepare_inputs(StepPlan(2, [], [], ["r"], [3])).metadata
    assert md.group_metadata[0].slot_mapping.tolist()[-1] == 16 * B
    assert md.slot_mapping.tolist()[-1] == 6 * B


def test_a_pipeline_stage_allocates_only_the_slots_of_its_layers() -> None:
    layout = plan_kv_groups(gemma3_1b_windows())
    first_stage = stage_slots(layout, range(0, 3))  # 3 local layers: slots 0, 1, 2
    assert first_stage == {0: 0, 1: 1, 2: 2}
    last_stage = stage_slots(layout, range(24, 26))  # the 2-layer local group: slots 0, 1
    assert last_stage == {0: 0, 1: 1}
    assert stage_slots(single_group(26), range(13, 26)) == {i: i - 13 for i in range(13, 26)}


def test_admission_counts_the_blocks_of_every_group() -> None:
    """A request is refused when its blocks over all groups (a sliding one: its window
    plus one chunk) cannot fit the pool: it would be preempted forever."""
    assert max_blocks_held((None, 1024), 8192, 16, 2048) == 512 + (1024 + 2048 - 2) // 16 + 2
    assert max_blocks_held((None, 1024), 100, 16, 2048) == 2 * 7  # short: every block
    limits = EngineLimits(
        vocab_size=100, max_model_len=64, block_size=B, num_blocks=10,
        eos_token_ids=frozenset(), kv_group_windows=(None, W), max_chunk_tokens=8,
    )  # fmt: skip
    assert check_lengths([1] * 16, SamplingParams(max_tokens=4), limits) == 4  # 5 + 5 blocks
    with pytest.raises(PromptTooLongError, match="needs 11 KV blocks"):
        check_lengths([1] * 20, SamplingParams(max_tokens=4), limits)  # 6 + 5 blocks
