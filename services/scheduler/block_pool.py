"""The pool of KV blocks: reference counts, an LRU free list and the prefix-cache map.

Every block is in exactly one of three states::

    in use            ref_cnt > 0, not in the free queue, hashed or not
    cached, free      ref_cnt == 0, in the free queue, hashed: a hit revives it
    free              ref_cnt == 0, in the free queue, no hash

Eviction is lazy (nano-vllm): a freed block keeps its hash and stays findable until
`get_new_blocks` pops it from the front of the free queue for someone else. The queue
order is the eviction order (vLLM's `FreeKVCacheBlockQueue`)::

    front (evict first)                                              back (evict last)
    [free, unhashed blocks] [cached blocks, least recently freed ... most recently freed]

Hashed blocks are appended at the back (LRU); unhashed ones are pushed to the front
because they hold nothing worth keeping, so they go before any cached block.

Block id 0 is an ordinary block: kvflow pads with slot -1 (never written), so no
"null block" is needed as a padding target, as vLLM reserves one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvflow.block_hash import BlockHash


class KVBlock:
    """One block of `block_size` KV slots; links are set only while it is free."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append(left) and remove.

    Two sentinel blocks (id -1) bracket the list, so a block is in the queue exactly
    when its `prev_free` is set and no operation needs an empty-list special case.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        """Front (next to evict) to back."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        prev = self._tail.prev_free
        assert prev is not None
        self._link(prev, block, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        after = self._head.next_free
        assert after is not None
        self._link(self._head, block, after)

    def remove(self, block: KVBlock) -> None:
        prev, after = block.prev_free, block.next_free
        assert prev is not None and after is not None, f"{block} is not in the free queue"
        prev.next_free = after
        after.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link(self, prev: KVBlock, block: KVBlock, after: KVBlock) -> None:
        assert block.prev_free is None, f"{block} is already in the free queue"
        prev.next_free = block
        block.prev_free = prev
        block.next_free = after
        after.prev_free = block
        self._len += 1


class BlockPool:
    """All KV blocks of one cache, handed out by reference count.

    Invariants (see `check_integrity`): a block is in the free queue iff its ref_cnt is
    0; `_cached` maps hash -> block and is exactly the set of blocks whose `block_hash`
    is set (one block per hash: a duplicate full block simply stays unhashed).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached-but-unreferenced)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0..1."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (front first); for tests and debugging."""
        return [block.block_id for block in self._free_queue]

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock] | None:
        """Take `num_blocks` blocks from the front of the free queue (ref_cnt 1 each).

        None (and nothing changed) when fewer are free. A reused cached block loses its
        hash: its old KV is about to be overwritten.
        """
        if num_blocks > len(self._free_queue):
            return None
        blocks = []
        for _ in range(num_blocks):
            block = self._free_queue.popleft()
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving those that were free."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in the given order = eviction order of the freed."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_queue.appendleft(block)
                else:
                    self._free_queue.append(block)

    def cache_full_blocks(
        self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Record the hashes of blocks that just became full (pairwise).

        A block already hashed (a cache hit) keeps its hash; a block whose hash is
        already cached on another block (two requests computed the same content)
        stays unhashed, so each hash names one block.
        """
        if not self.enable_prefix_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            assert block.ref_cnt > 0, f"caching unreferenced {block}"
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Forget a block's hash (its KV will not be written after all)."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; refused (False) while any block is in use, like vLLM."""
        if len(self._free_queue) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant of the class docstring holds."""
        in_queue: set[int] = set()
        for block in self._free_queue:
            known = 0 <= block.block_id < self.num_blocks and self.blocks[block.block_id] is block
            check_invariant(known, "foreign %s in the free queue", block)
            check_invariant(block.block_id not in in_queue, "%s twice in the free queue", block)
            check_invariant(block.ref_cnt == 0, "%s is in the free queue but referenced", block)
            in_queue.add(block.block_id)
            check_invariant(len(in_queue) <= self.num_blocks, "free queue has a cycle")
        check_invariant(len(in_queue) == len(self._free_queue), "free queue length is wrong")
        num_in_use = sum(1 for block in self.blocks if block.ref_cnt > 0)
        check_invariant(
            num_in_use + len(in_queue) == self.num_blocks, "blocks are lost or negative"
        )
        for block in self.blocks:
            listed = block.prev_free is not None
            check_invariant(
                listed == (block.block_id in in_queue), "%s has stale free links", block
            )
            if block.block_hash is not None:
                check_invariant(self._cached.get(block.block_hash) is block, "%s not in map", block)
        for block_hash, block in self._cached.items():
            check_invariant(block.block_hash == block_hash, "map entry of %s is stale", block)


def check_invariant(condition: bool, message: str, *args: object) -> None:
    """An invariant check that survives `python -O` (unlike assert). The message is
    formatted (`message % args`) only when the check fails: checks run once per block,
    and a block's repr on every pass would cost more than the checks themselves."""
    if not condition:
        raise AssertionError(message % args if args else message)
