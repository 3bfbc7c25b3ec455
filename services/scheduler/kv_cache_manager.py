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

Hybrid models (kvflow/kv_groups.py) keep one table per layer group over the one pool
(kv_cache_group.py): a sliding-window group releases the blocks that left its window at
each allocation. Group 0's table travels as `block_ids` as before; the other groups'
travel beside it (`group_block_ids`), so a one-group model sends what it always did.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple, Protocol

from kvflow.block_hash import BlockHash, ImageSpan, extend_block_hashes
from kvflow.services.scheduler.block_pool import BlockPool, check_invariant
from kvflow.services.scheduler.kv_cache_group import NULL_BLOCK, KVCacheGroup

__all__ = ["NULL_BLOCK", "CacheableRequest", "ComputedBlocks", "KVCacheManager"]


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
    def image_spans(self) -> list[ImageSpan]: ...  # placeholder runs of its images
    @property
    def lora_int_id(self) -> int: ...  # 0: the base model


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: whole blocks, so num_computed_tokens = len(ids) * block_size.
    `block_ids` is group 0's table of the hit, `group_block_ids` the other groups'
    (NULL_BLOCK where a sliding window needs no block)."""

    block_ids: list[int]
    num_computed_tokens: int
    group_block_ids: tuple[list[int], ...] = ()


class KVCacheManager:
    """Per-request block tables, one per layer group, over one `BlockPool`.

    Per request it keeps: per group its block ids (position order) and cache marks
    (kv_cache_group.py), the hashes of its known full blocks (computed incrementally,
    shared by the groups) and, for groups > 0, the ids appended since the worker last
    heard of them. Counters `prefix_cache_queries` / `prefix_cache_hits` (tokens) only
    grow.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.groups = [
            KVCacheGroup(i, window, block_size, self.block_pool)
            for i, window in enumerate(group_windows)
        ]
        self._sliding = [g for g in self.groups if g.window is not None]
        self._one_full_group = len(self.groups) == 1 and not self._sliding
        self._no_hits: tuple[list[int], ...] = tuple([] for _ in self.groups)  # never mutated
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._unsent: dict[str, list[list[int]]] = {}  # groups > 0: appended, not yet sent

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
        per_group = -(-num_tokens // self.block_size)
        return per_group * len(self.groups) <= self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table of group 0 ([] if it holds none)."""
        return list(self.groups[0].tables.get(request_id, ()))

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Copies of the request's tables of groups 1.. ([] for a one-group model); the
        worker learns them whole, so nothing of them is left unsent."""
        self._unsent.pop(request_id, None)
        return [list(g.tables.get(request_id, ())) for g in self.groups[1:]]

    def take_new_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The ids appended to groups 1.. since the worker last heard ([] if none)."""
        return self._unsent.pop(request_id, [])

    def get_computed_blocks(self, request: CacheableRequest) -> ComputedBlocks:
        """Longest cached prefix of a request that holds no blocks yet, agreed by every
        group (a sliding group needs only the blocks in the window before the hit).

        At least one token is left to compute (the model must run on the last token to
        sample), so a hit on every full block drops the last one. Valid only until the
        next allocation: call `allocate_slots` with it right away.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0)
        assert request.request_id not in self.groups[0].tables, "request already holds blocks"
        num_tokens = len(request.all_token_ids)
        hashes = self._block_hashes(request)
        num_hit = (num_tokens - 1) // self.block_size
        while True:  # each group's hit is <= the bound: shrink it until all agree
            agreed = min(group.longest_hit(hashes, num_hit) for group in self.groups)
            done = agreed == num_hit or len(self.groups) == 1  # one group agrees at once
            num_hit = agreed
            if done:
                break
        tables = [group.hit_ids(hashes, num_hit) for group in self.groups]
        num_hit_tokens = num_hit * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return ComputedBlocks(tables[0], num_hit_tokens, tuple(tables[1:]))

    def allocate_slots(
        self,
        request: CacheableRequest,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> list[int] | None:
        """Make room for the computed (or hit) tokens plus `num_new_tokens`.

        Returns the block ids appended to the request's table of group 0 by this call:
        the hit blocks first (on the first call), then fresh ones; often []. Those of
        the other groups wait in `take_new_group_block_ids`. None when the pool cannot
        satisfy it, and then nothing changed but the release of blocks that left a
        sliding window. For a request holding no blocks, `num_computed_tokens` may be 0
        or already the hit: only the hit counts.
        """
        request_id = request.request_id
        group = self.groups[0]
        table = group.tables.get(request_id)
        if table is not None and self._one_full_group:  # the common path, kept lean
            num_tokens = request.num_computed_tokens + num_new_tokens
            if -(-num_tokens // self.block_size) <= len(table):  # most decode steps
                num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
                committed, cached = group.marks.get(request_id, (0, 0))
                if num_full > cached and self.enable_prefix_caching:
                    group.cache_full_blocks(request, num_full, 0, self._block_hashes)
                elif committed != cached:
                    group.marks[request_id] = (cached, cached)
                return []
        holds = table is not None
        hits = self._no_hits
        if not holds:
            num_hit_tokens = computed.num_computed_tokens if computed is not None else 0
            assert request.num_computed_tokens in (0, num_hit_tokens), "KV without blocks"
            num_tokens = num_hit_tokens + num_new_tokens
            if computed is not None and computed.num_computed_tokens:
                hits = (computed.block_ids, *computed.group_block_ids)
        else:
            assert computed is None or not computed.block_ids, "hits need a fresh request"
            num_tokens = request.num_computed_tokens + num_new_tokens
            for group in self._sliding:
                group.release_skipped(request_id, request.num_computed_tokens)
        appended = self._take_blocks(request_id, hits, num_tokens, holds)
        if appended is None:
            return None
        if self.enable_prefix_caching:
            num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
            for group, hit_ids in zip(self.groups, hits):
                group.cache_full_blocks(request, num_full, len(hit_ids), self._block_hashes)
        return appended

    def fork(
        self, parent: CacheableRequest, child_id: str, num_new_tokens: int = 1
    ) -> list[list[int]] | None:
        """Give `child_id` the KV of the parent's computed tokens, copy-on-write::

            parent  [ full ][ full ][ part.. ]        the parent keeps its own blocks
            child   [ full ][ full ][ copy.. ][ new ]  full blocks shared (one more ref),
                                                    the partial one copied, room for
                                                    `num_new_tokens` more

        Returns the [source, destination] block copies the worker must make before the
        child's first step, or None (nothing changed) when the pool lacks blocks. With
        several groups each forks its own table (a block that left a window stays out)."""
        assert all(child_id not in g.tables for g in self.groups), f"{child_id} holds blocks"
        num_computed = parent.num_computed_tokens
        num_full = num_computed // self.block_size
        num_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        per_group = num_blocks - num_full
        new_blocks = self.block_pool.get_new_blocks(per_group * len(self.groups))
        if new_blocks is None:
            return None
        copies: list[list[int]] = []
        for i, group in enumerate(self.groups):
            copies += _fork_table(group, parent.request_id, child_id, num_computed,
                                  [b.block_id for b in new_blocks[i * per_group :][:per_group]])  # fmt: skip
        self._req_hashes[child_id] = list(self._req_hashes.get(parent.request_id, [])[:num_full])
        return copies

    def free(self, request_id: str, *, step_discarded: bool = False) -> None:
        """Release a request's blocks, tail first (its tail is evicted before its prefix).

        `step_discarded`: the request is withdrawn from the step whose allocation was
        its last (same-step preemption), so that step will not write its KV. Freeing a
        request that holds nothing (e.g. aborted while waiting) is a no-op, but call it
        anyway: it also drops the request's stored hashes.
        """
        self._req_hashes.pop(request_id, None)
        self._unsent.pop(request_id, None)
        for group in self.groups:
            group.free(request_id, step_discarded)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing done) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: ref counts = holders; a block in one group only;
        cached blocks match their hashes."""
        pool = self.block_pool
        pool.check_integrity()
        tables = [g.tables.values() for g in self.groups]
        holders = Counter(chain.from_iterable(chain.from_iterable(tables)))
        holders.pop(NULL_BLOCK, None)
        for block in pool.blocks:
            refs = holders.get(block.block_id, 0)
            check_invariant(block.ref_cnt == refs, "%s has %s holders", block, refs)
        owner: dict[int, int] = {}
        for group in self.groups:
            for block_id in chain.from_iterable(group.tables.values()):
                if len(self.groups) == 1:
                    break  # one group: nothing to mix up
                first = owner.setdefault(block_id, group.index)
                ok = block_id == NULL_BLOCK or first == group.index
                check_invariant(ok, "block %s in groups %s and %s", block_id, first, group.index)
            group.check_integrity(self._req_hashes)

    def _block_hashes(self, request: CacheableRequest) -> list[BlockHash]:
        hashes = self._req_hashes.setdefault(request.request_id, [])
        return extend_block_hashes(
            hashes,
            request.all_token_ids,
            self.block_size,
            request.cache_salt,
            request.image_spans,
            request.lora_int_id,
        )

    def _take_blocks(
        self, request_id: str, hits: Sequence[list[int]], num_tokens: int, holds: bool
    ) -> list[int] | None:
        """Reference the hit blocks and take fresh ones in every group, or change nothing
        (None); returns group 0's appended ids."""
        num_blocks = -(-num_tokens // self.block_size)
        needed = [
            max(0, num_blocks - len(g.tables.get(request_id, ())) - len(h))
            for g, h in zip(self.groups, hits)
        ]
        if hits is self._no_hits and not any(needed):  # most steps: room already held
            if not holds:
                for group in self.groups:
                    group.tables[request_id] = []
            return []
        pool = self.block_pool
        revived = sum(g.num_revived(h) for g, h in zip(self.groups, hits))
        if sum(needed) + revived > pool.num_free_blocks:
            return None
        for group, hit_ids in zip(self.groups, hits):  # first: no eviction may take them
            group.touch_hits(hit_ids)
        appended = []
        for group, hit_ids, num_new in zip(self.groups, hits, needed):
            new_blocks = pool.get_new_blocks(num_new)
            assert new_blocks is not None
            ids = hit_ids + [block.block_id for block in new_blocks]
            group.tables.setdefault(request_id, []).extend(ids)
            appended.append(ids)
        if len(appended) > 1 and any(appended[1:]):
            unsent = self._unsent.setdefault(request_id, [[] for _ in appended[1:]])
            for pending, ids in zip(unsent, appended[1:]):
                pending.extend(ids)
        return appended[0]


def _fork_table(
    group: KVCacheGroup, parent_id: str, child_id: str, num_computed: int, new_ids: list[int]
) -> list[list[int]]:
    """`child_id`'s table in one group: the parent's full blocks shared (one more ref),
    then `new_ids`; the copy of the parent's partial block, if any."""
    block_size = group.block_size
    parent_ids = group.tables.get(parent_id, [])
    num_full = num_computed // block_size
    assert len(parent_ids) >= -(-num_computed // block_size), "parent lacks KV"
    shared = parent_ids[:num_full]
    group.pool.touch(group.pool.blocks[b] for b in shared if b != NULL_BLOCK)
    group.tables[child_id] = shared + new_ids
    num_cached = min(num_full, group.marks.get(parent_id, (0, 0))[1])
    group.marks[child_id] = (num_cached, num_cached)
    if num_computed % block_size == 0 or parent_ids[num_full] == NULL_BLOCK:
        return []
    return [[parent_ids[num_full], new_ids[0]]]
