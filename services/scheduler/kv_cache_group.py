"""One KV cache group's block tables (kvflow/kv_groups.py): full attention or a window.

A full-attention group keeps every block of a request. A sliding-window group of
window W drops the blocks no future query reads: the query at position p reads keys
p - W + 1 .. p, so once `num_computed` tokens have KV, the next query (at num_computed,
or the first of a chunk starting there) needs nothing before block
(num_computed - W + 1) // B. Those blocks go back to the pool (hashed ones stay
findable for prefix hits) and their table entries become NULL_BLOCK, which the
attention kernels never read: they start at the window's first block::

    W = 8, B = 4, num_computed = 13 -> keys from 6 on -> first needed block 1
    table   [NULL, b7, b2, b9]      (block 0 = tokens 0..3 released)

Prefix hits of such a group need only the blocks inside the window before the hit
point (`longest_hit`); the blocks before it are NULL in the new request's table.
Cached blocks are keyed per group: group g > 0 suffixes the block hash with g, so the
same tokens cached by two groups are two distinct pool entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvflow.block_hash import BlockHash
from kvflow.services.scheduler.block_pool import BlockPool, check_invariant

NULL_BLOCK = -1  # a table entry whose block left the window: never read, never freed


class KVCacheGroup:
    """Per request: its table (position order, NULL_BLOCK where released) and cache
    marks `(committed, cached)` as in KVCacheManager."""

    def __init__(self, index: int, window: int | None, block_size: int, pool: BlockPool):
        self.index = index
        self.window = window
        self.block_size = block_size
        self.pool = pool
        self._suffix = b"" if index == 0 else index.to_bytes(2, "little")
        self.tables: dict[str, list[int]] = {}
        self.marks: dict[str, tuple[int, int]] = {}

    def key(self, block_hash: BlockHash) -> BlockHash:
        """The pool's cache key of a block of this group."""
        return block_hash if not self._suffix else BlockHash(block_hash + self._suffix)

    def first_needed_block(self, num_computed: int) -> int:
        """Blocks before this one are read by no query at position >= num_computed."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    # ---- prefix hits -------------------------------------------------------------------

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> int:
        """The most blocks h <= max_blocks such that this group holds every block a
        query at position h * B reads: all h for full attention, the window's for W."""
        cached = self.pool.get_cached_block
        if self.window is None:
            for index in range(max_blocks):
                if cached(self.key(hashes[index])) is None:
                    return index
            return max_blocks
        if self.first_needed_block(max_blocks * self.block_size) >= max_blocks:
            return max_blocks  # a window within one block: nothing to read back
        # Scan back over runs of cached blocks: a run [index, end) is a hit of `end`
        # blocks once it reaches back to end's first needed block (one lookup a block).
        run = 0
        for index in range(max_blocks - 1, -1, -1):
            if cached(self.key(hashes[index])) is None:
                run = 0
                continue
            run += 1
            if index <= self.first_needed_block((index + run) * self.block_size):
                return index + run
        return 0

    def hit_ids(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[int]:
        """The table of a hit of `num_blocks` blocks (as `longest_hit` agreed)."""
        first = self.first_needed_block(num_blocks * self.block_size)
        ids = [NULL_BLOCK] * first
        for block_hash in hashes[first:num_blocks]:
            block = self.pool.get_cached_block(self.key(block_hash))
            assert block is not None, "hit block evicted before allocation"
            ids.append(block.block_id)
        return ids

    # ---- allocation --------------------------------------------------------------------

    def release_skipped(self, request_id: str, num_computed: int) -> None:
        """Free the blocks no query from position num_computed on reads (oldest first)."""
        table = self.tables.get(request_id)
        if table is None or self.window is None:
            return
        first = min(self.first_needed_block(num_computed), len(table))
        released = [self.pool.blocks[b] for b in table[:first] if b != NULL_BLOCK]
        if released:
            table[:first] = [NULL_BLOCK] * first
            self.pool.free_blocks(released)

    def touch_hits(self, hit_ids: list[int]) -> None:
        """Reference the hit blocks (the caller checked there is room to revive them)."""
        pool = self.pool
        pool.touch(pool.blocks[b] for b in hit_ids if b != NULL_BLOCK)

    def num_revived(self, hit_ids: list[int]) -> int:
        """Hit blocks that are free now (taking them costs free blocks)."""
        blocks = self.pool.blocks
        return sum(1 for b in hit_ids if b != NULL_BLOCK and blocks[b].ref_cnt == 0)

    def cache_full_blocks(
        self,
        request: Any,  # a CacheableRequest
        num_full: int,
        num_hits: int,
        hashes_of: Callable[[Any], list[BlockHash]],  # computed only when needed
    ) -> None:
        """Offer the blocks filled by known tokens (`num_full` blocks of them) since the
        last call to the cache."""
        request_id = request.request_id
        _, cached = self.marks.get(request_id, (num_hits, num_hits))
        if num_full <= cached:
            self.marks[request_id] = (cached, cached)
            return
        table = self.tables[request_id]
        hashes = hashes_of(request)
        blocks = self.pool.blocks
        new = table[cached:num_full]
        assert NULL_BLOCK not in new, "a block left the window before it was cached"
        keys = [self.key(h) for h in hashes[cached:num_full]]
        self.pool.cache_full_blocks([blocks[b] for b in new], keys)
        self.marks[request_id] = (cached, num_full)

    def free(self, request_id: str, step_discarded: bool) -> None:
        """Release a request's blocks, tail first; see KVCacheManager.free."""
        table = self.tables.pop(request_id, None)
        committed, cached = self.marks.pop(request_id, (0, 0))
        if table is None:
            return
        blocks = self.pool.blocks
        if step_discarded:
            for block_id in table[committed:cached]:
                if block_id != NULL_BLOCK:
                    self.pool.uncache(blocks[block_id])
        held = [blocks[b] for b in reversed(table) if b != NULL_BLOCK]
        self.pool.free_blocks(held)

    def check_integrity(self, hashes_of: dict[str, list[BlockHash]]) -> None:
        """Marks in range, no block twice in a table, cached blocks under their hash."""
        pool = self.pool
        check_invariant(self.marks.keys() <= self.tables.keys(), "stale marks")
        for request_id, table in self.tables.items():
            held = [b for b in table if b != NULL_BLOCK]
            check_invariant(len(set(held)) == len(held), "%s: dup block", request_id)
            committed, cached = self.marks.get(request_id, (0, 0))
            check_invariant(0 <= committed <= cached <= len(table), "%s: marks", request_id)
            hashes = hashes_of.get(request_id, [])
            for index, block_id in enumerate(table):
                if block_id == NULL_BLOCK:
                    check_invariant(self.window is not None, "%s: NULL in full group", request_id)
                    continue
                key = pool.blocks[block_id].block_hash
                ok = key is None or (index < len(hashes) and self.key(hashes[index]) == key)
                check_invariant(ok, "%s: block %s cached under another hash", request_id, index)
