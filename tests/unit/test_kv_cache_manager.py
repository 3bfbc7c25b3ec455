"""KVCacheManager: exact block ids, free orders and prefix hits (vLLM's
test_prefix_caching.py style), plus a randomized stress test with a KV-content model."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvflow.block_hash import hash_block_tokens
from kvflow.services.scheduler.kv_cache_manager import ComputedBlocks, KVCacheManager


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_int_id: int = 0
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)
    image_spans: list[tuple[int, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)


def _admit(mgr: KVCacheManager, req: Req, num_new: int | None = None) -> list[int] | None:
    """Schedule a new request the way the scheduler does: hit lookup, then allocation."""
    computed = mgr.get_computed_blocks(req)
    if num_new is None:
        num_new = len(req.all_token_ids) - computed.num_computed_tokens
    new_ids = mgr.allocate_slots(req, num_new, computed)
    if new_ids is not None:
        req.num_computed_tokens = computed.num_computed_tokens + num_new
    mgr.check_integrity()
    return new_ids


def _hashes(mgr: KVCacheManager, block_ids: list[int]) -> list[bytes | None]:
    return [mgr.block_pool.blocks[i].block_hash for i in block_ids]


def test_prefix_hit_shares_full_blocks_but_not_the_partial_one() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    r0 = Req("r0", list(range(10)))
    assert mgr.get_computed_blocks(r0) == ComputedBlocks([], 0)
    assert mgr.allocate_slots(r0, 10) == [0, 1, 2]
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert _hashes(mgr, [0, 1, 2]) == [h0, hash_block_tokens(h0, [4, 5, 6, 7]), None]
    r0.num_computed_tokens = 10
    r1 = Req("r1", [*range(8), 100, 101, 102])
    computed = mgr.get_computed_blocks(r1)
    assert computed == ComputedBlocks([0, 1], 8)
    assert mgr.allocate_slots(r1, 3, computed) == [0, 1, 3]  # hits first, then fresh
    assert mgr.get_block_ids("r1") == [0, 1, 3]
    assert [b.ref_cnt for b in mgr.block_pool.blocks[:4]] == [2, 2, 1, 1]
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (21, 8)
    assert mgr.num_free_blocks == 7
    mgr.check_integrity()
    mgr.free("r0")  # block 2 (partial, unhashed) to the front; 0 and 1 still used by r1
    assert mgr.block_pool.free_block_ids() == [2, 4, 5, 6, 7, 8, 9, 10]
    mgr.free("r1")  # tail first: 3 to the front, then 1 and 0 at the back
    assert mgr.block_pool.free_block_ids() == [3, 2, 4, 5, 6, 7, 8, 9, 10, 1, 0]
    assert mgr.get_block_ids("r1") == [] and mgr.usage == 0.0
    mgr.check_integrity()


def test_decode_caches_a_block_once_its_tokens_are_known() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    req = Req("r", [1, 2, 3, 4, 5, 6])
    assert _admit(mgr, req) == [0, 1]
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert _hashes(mgr, [0, 1]) == [h0, None]
    req.all_token_ids.append(7)  # sampled; 7 tokens, 6 computed
    assert mgr.allocate_slots(req, 1) == []
    assert _hashes(mgr, [1]) == [None]  # positions 4..7 not all known yet
    req.num_computed_tokens = 7
    req.all_token_ids.append(8)
    assert mgr.allocate_slots(req, 1) == []
    assert _hashes(mgr, [1]) == [hash_block_tokens(h0, [5, 6, 7, 8])]
    req.num_computed_tokens = 8
    req.all_token_ids.append(9)
    assert mgr.allocate_slots(req, 1) == [2]
    mgr.check_integrity()


def test_full_prompt_hit_leaves_one_token_to_compute() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    assert _admit(mgr, Req("r0", list(range(8)))) == [0, 1]
    r1 = Req("r1", list(range(8)))
    computed = mgr.get_computed_blocks(r1)
    assert computed == ComputedBlocks([0], 4)  # the last full block is recomputed
    assert mgr.allocate_slots(r1, 4, computed) == [0, 2]
    assert _hashes(mgr, [2]) == [None]  # same content as block 1: one block per hash
    r2 = Req("r2", list(range(9)))
    computed = mgr.get_computed_blocks(r2)
    assert computed == ComputedBlocks([0, 1], 8)
    r2.num_computed_tokens = 8  # the scheduler may count the hit before allocating
    assert mgr.allocate_slots(r2, 1, computed) == [0, 1, 3]
    assert [b.ref_cnt for b in mgr.block_pool.blocks[:4]] == [3, 2, 1, 1]
    mgr.check_integrity()


def test_cache_salt_separates_tenants() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    prompt = [*range(8), 99]
    assert _admit(mgr, Req("a", prompt, cache_salt="tenant-a")) == [0, 1, 2]
    assert mgr.get_computed_blocks(Req("b", prompt, cache_salt="tenant-b")).block_ids == []
    assert mgr.get_computed_blocks(Req("n", prompt)).block_ids == []
    hit = mgr.get_computed_blocks(Req("a2", prompt, cache_salt="tenant-a"))
    assert hit == ComputedBlocks([0, 1], 8)


def test_eviction_is_lru_and_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    assert _admit(mgr, Req("r0", list(range(16)))) == [0, 1, 2, 3]
    mgr.free("r0")
    assert mgr.block_pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1, 0]
    assert _admit(mgr, Req("r1", list(range(100, 128)))) == [4, 5, 6, 7, 8, 9, 10]
    assert _admit(mgr, Req("r2", list(range(200, 206)))) == [3, 2]  # evicts r0's tail
    assert _hashes(mgr, [3]) == [hash_block_tokens(None, [200, 201, 202, 203])]
    assert mgr.get_computed_blocks(Req("r3", list(range(16)))) == ComputedBlocks([0, 1], 8)


def test_blocks_freed_earlier_are_evicted_earlier() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    assert _admit(mgr, Req("a", list(range(8)))) == [0, 1]
    assert _admit(mgr, Req("b", list(range(50, 58)))) == [2, 3]
    mgr.free("a")
    mgr.free("b")
    assert mgr.block_pool.free_block_ids() == [4, 5, 1, 0, 3, 2]
    assert _admit(mgr, Req("c", list(range(100, 116)))) == [4, 5, 1, 0]
    assert mgr.get_computed_blocks(Req("a2", list(range(8)))) == ComputedBlocks([], 0)
    assert mgr.get_computed_blocks(Req("b2", list(range(50, 58)))) == ComputedBlocks([2], 4)


def test_failed_allocation_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    _admit(mgr, Req("r0", list(range(16))))
    mgr.free("r0")
    assert _admit(mgr, Req("r1", list(range(100, 124)))) == [4, 5, 6, 7, 8, 9]
    r2 = Req("r2", [*range(12), *range(300, 312)])
    computed = mgr.get_computed_blocks(r2)
    assert computed == ComputedBlocks([0, 1, 2], 12)
    before = (mgr.block_pool.free_block_ids(), mgr.block_pool.num_cached_blocks)
    # 3 fresh blocks + reviving the 3 free hit blocks = 6 > 5 free blocks
    assert mgr.allocate_slots(r2, 12, computed) is None
    assert (mgr.block_pool.free_block_ids(), mgr.block_pool.num_cached_blocks) == before
    assert [b.ref_cnt for b in mgr.block_pool.blocks[:3]] == [0, 0, 0]
    assert mgr.get_block_ids("r2") == []
    mgr.check_integrity()
    assert mgr.allocate_slots(r2, 4, computed) == [0, 1, 2, 10]  # a smaller chunk fits
    assert mgr.block_pool.free_block_ids() == [3]
    r1 = Req("r1", list(range(100, 125)), num_computed_tokens=24)
    assert _admit(mgr, Req("r3", [7, 7, 7])) == [3]
    assert mgr.allocate_slots(r1, 1) is None  # a decode that needs a block: pool full
    assert mgr.get_block_ids("r1") == [4, 5, 6, 7, 8, 9]
    mgr.check_integrity()


def test_chunked_prefill_caches_each_chunk_as_it_is_allocated() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    req = Req("r", list(range(10)))
    assert _admit(mgr, req, num_new=4) == [0]
    assert mgr.get_computed_blocks(Req("x", list(range(10)))) == ComputedBlocks([0], 4)
    assert mgr.allocate_slots(req, 4) == [1]
    req.num_computed_tokens = 8
    assert mgr.allocate_slots(req, 2) == [2]
    assert [h is not None for h in _hashes(mgr, [0, 1, 2])] == [True, True, False]
    mgr.check_integrity()


def test_speculative_tokens_get_slots_but_only_known_tokens_are_hashed() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    req = Req("r", list(range(5)))
    assert _admit(mgr, req) == [0, 1]
    req.all_token_ids.append(5)  # 6 known, 5 computed
    assert mgr.allocate_slots(req, 1 + 3) == [2]  # 1 sampled token + 3 drafts = 9 slots
    assert _hashes(mgr, [1]) == [None]  # positions 6, 7 hold drafts, not known tokens
    req.all_token_ids += [6, 7, 8]  # 2 drafts accepted + 1 bonus token
    req.num_computed_tokens = 8
    assert mgr.allocate_slots(req, 1 + 3) == []  # 12 slots: still 3 blocks
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert _hashes(mgr, [1]) == [hash_block_tokens(h0, [4, 5, 6, 7])]
    mgr.check_integrity()


@pytest.mark.parametrize("discarded", [False, True])
def test_step_discarded_free_drops_only_the_last_allocations_hashes(discarded) -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4)
    req = Req("r", list(range(10)))
    assert _admit(mgr, req, num_new=4) == [0]  # computed in an earlier step
    assert mgr.allocate_slots(req, 4) == [1]  # this step: withdrawn before it ran
    mgr.free("r", step_discarded=discarded)
    expected = ComputedBlocks([0, 1], 8) if not discarded else ComputedBlocks([0], 4)
    assert mgr.get_computed_blocks(Req("x", list(range(10)))) == expected
    if discarded:
        assert mgr.block_pool.free_block_ids() == [1, *range(2, 11), 0]
    mgr.check_integrity()


def test_prefix_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=4, enable_prefix_caching=False)
    assert _admit(mgr, Req("r0", list(range(10)))) == [0, 1, 2]
    assert _admit(mgr, Req("r1", list(range(10)))) == [3, 4, 5]
    assert _hashes(mgr, [0, 1, 2]) == [None, None, None]
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (0, 0)
    mgr.free("r0")  # uncached blocks go to the front: reused in id order
    assert mgr.block_pool.free_block_ids() == [0, 1, 2, 6, 7, 8, 9, 10]


def test_reset_prefix_cache_and_usage() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    _admit(mgr, Req("r0", list(range(9))))
    assert mgr.usage == pytest.approx(0.3)
    assert mgr.can_fit(28) and not mgr.can_fit(29)
    assert mgr.reset_prefix_cache() is False
    mgr.free("r0")
    assert mgr.get_computed_blocks(Req("a", list(range(9)))).num_computed_tokens == 8
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(Req("b", list(range(9)))) == ComputedBlocks([], 0)
    assert mgr.block_pool.num_cached_blocks == 0


def test_free_of_a_request_without_blocks_is_a_noop() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    mgr.free("never-seen")
    waiting = Req("w", list(range(8)))
    mgr.get_computed_blocks(waiting)  # stores the request's hashes
    mgr.free("w")
    assert mgr._req_hashes == {} and mgr.num_free_blocks == 4
    assert mgr.allocate_slots(Req("z", [1, 2]), 0) == []
    assert mgr.get_block_ids("z") == []
    mgr.check_integrity()


def test_check_integrity_detects_wrong_refs_and_wrong_hashes() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    _admit(mgr, Req("r", [1, 2, 3, 4, 5]))
    mgr.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="holders"):
        mgr.check_integrity()
    mgr.block_pool.blocks[0].ref_cnt -= 1
    mgr._req_hashes["r"].reverse()
    with pytest.raises(AssertionError, match="another hash"):
        mgr.check_integrity()


# ---- randomized stress test --------------------------------------------------------


class _Sim:
    """A tiny scheduler + model over the manager. KV "content" of position p is an id
    of the whole prefix tokens[0..p] (and salt); a hit must find exactly that content."""

    def __init__(self, seed: int, block_size: int, num_blocks: int, caching: bool) -> None:
        self.rng = random.Random(seed)
        self.bs = block_size
        self.mgr = KVCacheManager(num_blocks, block_size, caching)
        self.kv = [[0] * block_size for _ in range(num_blocks)]
        self.max_len = 8 * block_size + 8
        self.stems = [
            self._tokens(3 * block_size + self.rng.randint(0, block_size)) for _ in "abcd"
        ]
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.counts = {"hit_blocks": 0, "preempted": 0, "discarded": 0, "finished": 0}

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(50) for _ in range(n)]

    def _ident(self, req: Req, tokens: list[int]) -> list[int]:
        out, prev = [], hash(("root", req.cache_salt))
        for tok in tokens:
            prev = hash((prev, tok))
            out.append(prev)
        return out

    def _write(self, req: Req, start: int, tokens: list[int]) -> None:
        ids = self.mgr.get_block_ids(req.request_id)
        for pos, value in enumerate(self._ident(req, tokens), 0):
            if pos >= start:
                self.kv[ids[pos // self.bs]][pos % self.bs] = value

    def _check_content(self, req: Req, num_tokens: int) -> None:
        ids = self.mgr.get_block_ids(req.request_id)
        for pos, value in enumerate(self._ident(req, req.all_token_ids[:num_tokens])):
            assert self.kv[ids[pos // self.bs]][pos % self.bs] == value, (req, pos)

    def new_request(self, index: int) -> None:
        stem = self.rng.choice(self.stems)
        prompt = stem[: self.rng.randint(0, len(stem))] + self._tokens(self.rng.randint(1, 6))
        salt = self.rng.choice([None, None, "tenant"])
        self.waiting.append(Req(f"q{index}", prompt, cache_salt=salt))

    def admit(self) -> None:
        req = self.waiting[0]
        computed = self.mgr.get_computed_blocks(req)
        hit = computed.num_computed_tokens
        num_new = self.rng.randint(1, len(req.all_token_ids) - hit)
        if self.rng.random() < 0.5:
            req.num_computed_tokens = hit  # both scheduler styles are accepted
        free_before = self.mgr.num_free_blocks
        if self.mgr.allocate_slots(req, num_new, computed) is None:
            req.num_computed_tokens = 0
            assert self.mgr.num_free_blocks == free_before
            assert self.mgr.get_block_ids(req.request_id) == []
            return
        self.counts["hit_blocks"] += len(computed.block_ids)
        req.num_computed_tokens = hit
        self._check_content(req, hit)  # the prefix cache handed out the right KV
        self.running.append(self.waiting.pop(0))
        self._run(req, num_new, drafts=[])

    def step(self, req: Req) -> None:
        remaining = len(req.all_token_ids) - req.num_computed_tokens
        drafts = self._tokens(self.rng.randint(0, 3)) if remaining == 1 else []
        num_new = self.rng.randint(1, remaining) if remaining > 1 else 1 + len(drafts)
        if self.mgr.allocate_slots(req, num_new) is None:
            self._preempt(req, discarded=False)
        elif self.rng.random() < 0.05:
            self._preempt(req, discarded=True)  # withdrawn before its step ran
        else:
            self._run(req, num_new, drafts)

    def _run(self, req: Req, num_new: int, drafts: list[int]) -> None:
        start = req.num_computed_tokens
        self._write(req, start, req.all_token_ids[: start + num_new - len(drafts)] + drafts)
        req.num_computed_tokens += num_new
        if req.num_computed_tokens >= len(req.all_token_ids):  # sample
            accepted = self.rng.randint(0, len(drafts))
            req.num_computed_tokens -= len(drafts) - accepted
            req.all_token_ids += [*drafts[:accepted], self.rng.randrange(50)]
        if len(req.all_token_ids) >= self.max_len:
            self.finish(req)

    def _preempt(self, req: Req, discarded: bool) -> None:
        self.mgr.free(req.request_id, step_discarded=discarded)
        self.counts["discarded" if discarded else "preempted"] += 1
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.insert(0, req)

    def finish(self, req: Req) -> None:
        if req in self.running:
            self._check_content(req, req.num_computed_tokens)  # nobody overwrote its KV
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.mgr.free(req.request_id)
        self.counts["finished"] += 1


@pytest.mark.parametrize(
    ("seed", "block_size", "num_blocks", "caching"),
    [(0, 4, 40, True), (1, 1, 40, True), (2, 16, 24, True), (3, 4, 40, False)],
)
def test_random_requests_keep_integrity_and_leak_nothing(
    seed, block_size, num_blocks, caching
) -> None:
    sim = _Sim(seed, block_size, num_blocks, caching)
    rng, mgr = sim.rng, sim.mgr
    for op in range(8_000):
        roll = rng.random()
        if roll < 0.2 and len(sim.waiting) < 8:
            sim.new_request(op)
        elif roll < 0.45 and sim.waiting:
            sim.admit()
        elif roll < 0.9 and sim.running:
            sim.step(rng.choice(sim.running))
        elif roll < 0.99 and (sim.running or sim.waiting):
            sim.finish(rng.choice(sim.running + sim.waiting))
        elif roll >= 0.99:
            assert mgr.reset_prefix_cache() == (mgr.num_free_blocks == num_blocks)
        mgr.check_integrity()
    for req in sim.running + sim.waiting:
        sim.finish(req)
    mgr.check_integrity()
    assert mgr.num_free_blocks == num_blocks and mgr.usage == 0.0
    assert sim.counts["finished"] > 600 and sim.counts["preempted"] > 10
    assert sim.counts["discarded"] > 10
    assert (sim.counts["hit_blocks"] > 100) == caching
    assert 0 <= mgr.prefix_cache_hits <= mgr.prefix_cache_queries
    assert mgr.reset_prefix_cache() and mgr.block_pool.num_cached_blocks == 0
