"""Which KV blocks each request holds, and the prefix-cache hits that save compute.

The scheduler talks to this class only (never to blocks): one `allocate_slots` per
request per step, `get_computed_blocks` before a request's first allocation, `free`
when it finishes, is aborted or preempted. What one `allocate_slots` covers::

    all_token_ids  |<------------------ known tokens ------------------>|
    positions      |<-- num_computed_tokens -->|<-------- num_new_tokens -------->|
                                                (chunk, 1 decode token, or 1 + k drafts)
    blocks         | held (or prefix hits)  ...|... new blocks, as many as needed |
    hashed after   |<-- full blocks below min(computed + new, known) -->|

Blocks are hashed when an allocation covers them, before the forward pass writes
them (vLLM's rule). That is safe because every later reader runs in that same
forward pass, after the layer stores the whole batch's K/V (the attention backend's
contract), or in a later step. The one exception is a request withdrawn from the step
that allocated for it (same-step preemption): `free(..., step_discarded=True)` then
drops the hashes its last allocation recorded, whose KV will never be written.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from typing import NamedTuple, Protocol

from kvflow.block_hash import BlockHash, extend_block_hashes
from kvflow.services.scheduler.block_pool import BlockPool, check_invariant


class CacheableRequest(Protocol):
    """What the cache manager reads from a request (tokens are only ever appended)."""

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> list[int]: ...  # prompt + output tokens so far
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def lora_int_id(self) -> int: ...  # 0: the base model


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: whole blocks, so num_computed_tokens = len(ids) * block_size."""

    block_ids: list[int]
    num_computed_tokens: int


class KVCacheManager:
    """Per-request block tables over one `BlockPool`.

    Per request it keeps: its block ids (position order), the hashes of its known full
    blocks (computed incrementally) and `(committed, cached)`: blocks[:cached] have been
    offered to the prefix cache, blocks[committed:cached] by the latest allocation.
    Counters `prefix_cache_queries` / `prefix_cache_hits` (tokens) only grow.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._req_block_ids: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._cache_marks: dict[str, tuple[int, int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (kvflow:kv_cache_usage_perc)."""
        return self.block_pool.usage

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request with no blocks could get room for `num_tokens` now."""
        return -(-num_tokens // self.block_size) <= self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] if it holds none)."""
        return list(self._req_block_ids.get(request_id, ()))

    def get_computed_blocks(self, request: CacheableRequest) -> ComputedBlocks:
        """Longest cached prefix of a request that holds no blocks yet.

        At least one token is left to compute (the model must run on the last token to
        sample), so a hit on every full block drops the last one. Valid only until the
        next allocation: call `allocate_slots` with it right away.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0)
        assert request.request_id not in self._req_block_ids, "request already holds blocks"
        num_tokens = len(request.all_token_ids)
        hashes = self._block_hashes(request)
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hit_ids = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_ids.append(block.block_id)
        num_hit_tokens = len(hit_ids) * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return ComputedBlocks(hit_ids, num_hit_tokens)

    def allocate_slots(
        self,
        request: CacheableRequest,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> list[int] | None:
        """Make room for the computed (or hit) tokens plus `num_new_tokens`.

        Returns the block ids appended to the request's table by this call: the hit
        blocks first (on the first call), then fresh ones; often []. None when the pool
        cannot satisfy it, and then nothing changed. For a request holding no blocks,
        `num_computed_tokens` may be 0 or already the hit: only the hit counts.
        """
        request_id = request.request_id
        block_ids = self._req_block_ids.get(request_id)
        hit_ids = computed.block_ids if computed is not None else []
        if block_ids is None:
            num_hit_tokens = computed.num_computed_tokens if computed is not None else 0
            assert request.num_computed_tokens in (0, num_hit_tokens), "KV without blocks"
            num_tokens = num_hit_tokens + num_new_tokens
            block_ids = []
        else:
            assert not hit_ids, "prefix hits apply only to a request holding no blocks"
            num_tokens = request.num_computed_tokens + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(block_ids) - len(hit_ids)
        appended: list[int] | None = []
        if hit_ids or needed > 0:
            appended = self._take_blocks(request, hit_ids, max(needed, 0))
            if appended is None:
                return None
            block_ids.extend(appended)
        self._req_block_ids[request_id] = block_ids
        if self.enable_prefix_caching:
            num_known = min(num_tokens, len(request.all_token_ids))
            self._cache_full_blocks(request, block_ids, num_known, len(hit_ids))
        return appended

    def free(self, request_id: str, *, step_discarded: bool = False) -> None:
        """Release a request's blocks, tail first (its tail is evicted before its prefix).

        `step_discarded`: the request is withdrawn from the step whose allocation was
        its last (same-step preemption), so that step will not write its KV. Freeing a
        request that holds nothing (e.g. aborted while waiting) is a no-op, but call it
        anyway: it also drops the request's stored hashes.
        """
        block_ids = self._req_block_ids.pop(request_id, None)
        committed, cached = self._cache_marks.pop(request_id, (0, 0))
        self._req_hashes.pop(request_id, None)
        if block_ids is None:
            return
        blocks = self.block_pool.blocks
        if step_discarded:
            for block_id in block_ids[committed:cached]:
                self.block_pool.uncache(blocks[block_id])
        self.block_pool.free_blocks([blocks[block_id] for block_id in reversed(block_ids)])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing done) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: ref counts = holders; cached blocks match their hashes."""
        pool = self.block_pool
        pool.check_integrity()
        holders = Counter(chain.from_iterable(self._req_block_ids.values()))
        for block in pool.blocks:
            refs = holders.get(block.block_id, 0)
            check_invariant(block.ref_cnt == refs, "%s has %s holders", block, refs)
        check_invariant(self._cache_marks.keys() <= self._req_block_ids.keys(), "stale marks")
        for request_id, block_ids in self._req_block_ids.items():
            check_invariant(len(set(block_ids)) == len(block_ids), "%s: dup block", request_id)
            committed, cached = self._cache_marks.get(request_id, (0, 0))
            check_invariant(0 <= committed <= cached <= len(block_ids), "%s: marks", request_id)
            hashes = self._req_hashes.get(request_id, [])
            for index, block_id in enumerate(block_ids):
                block_hash = pool.blocks[block_id].block_hash
                ok = block_hash is None or (index < len(hashes) and hashes[index] == block_hash)
                check_invariant(ok, "%s: block %s cached under another hash", request_id, index)

    def _block_hashes(self, request: CacheableRequest) -> list[BlockHash]:
        hashes = self._req_hashes.setdefault(request.request_id, [])
        return extend_block_hashes(
            hashes,
            request.all_token_ids,
            self.block_size,
            request.cache_salt,
            request.lora_int_id,
        )

    def _take_blocks(
        self, request: CacheableRequest, hit_ids: list[int], num_new_blocks: int
    ) -> list[int] | None:
        """Reference the hit blocks and take fresh ones, or change nothing (None)."""
        pool = self.block_pool
        hit_blocks = [pool.blocks[block_id] for block_id in hit_ids]
        if hit_blocks:
            hashes = self._req_hashes[request.request_id]
            assert all(b.block_hash == h for b, h in zip(hit_blocks, hashes)), "stale hit"
        num_revived = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_revived > pool.num_free_blocks:
            return None
        pool.touch(hit_blocks)  # first, so that get_new_blocks cannot evict them
        new_blocks = pool.get_new_blocks(num_new_blocks)
        assert new_blocks is not None
        return hit_ids + [block.block_id for block in new_blocks]

    def _cache_full_blocks(
        self, request: CacheableRequest, block_ids: list[int], num_known: int, num_hits: int
    ) -> None:
        """Offer the blocks filled by known tokens since the last call to the cache."""
        request_id = request.request_id
        _, cached = self._cache_marks.get(request_id, (num_hits, num_hits))
        num_full = num_known // self.block_size
        if num_full <= cached:
            self._cache_marks[request_id] = (cached, cached)
            return
        hashes = self._block_hashes(request)
        blocks = self.block_pool.blocks
        self.block_pool.cache_full_blocks(
            [blocks[block_id] for block_id in block_ids[cached:num_full]],
            hashes[cached:num_full],
        )
        self._cache_marks[request_id] = (cached, num_full)
