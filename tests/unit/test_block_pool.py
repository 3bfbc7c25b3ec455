"""BlockPool, FreeBlockQueue and block hashing: exact ids and free-queue orders."""

from __future__ import annotations

import hashlib

import pytest

from kvflow.block_hash import (
    BlockHash,
    extend_block_hashes,
    hash_block_tokens,
)
from kvflow.services.scheduler.block_pool import BlockPool, FreeBlockQueue, KVBlock


def _h(name: str) -> BlockHash:
    return BlockHash(hashlib.sha256(name.encode()).digest())


def _ids(blocks: list[KVBlock] | None) -> list[int]:
    assert blocks is not None
    return [block.block_id for block in blocks]


# ---- FreeBlockQueue ----------------------------------------------------------------


def test_free_queue_popleft_append_remove_keep_order() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # from the middle
    queue.remove(blocks[4])  # the last one
    assert [b.block_id for b in queue] == [1, 3]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.append(blocks[0])
    queue.appendleft(blocks[4])
    assert [b.block_id for b in queue] == [4, 1, 3, 0]
    assert len(queue) == 4


def test_free_queue_empty_popleft_raises_and_double_insert_is_caught() -> None:
    block = KVBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(AssertionError, match="already in the free queue"):
        queue.append(block)
    assert queue.popleft() is block
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(AssertionError, match="not in the free queue"):
        queue.remove(block)
    assert len(queue) == 0 and list(queue) == []


# ---- BlockPool ---------------------------------------------------------------------


def test_get_new_blocks_pops_in_id_order_and_none_when_short() -> None:
    pool = BlockPool(11)
    assert _ids(pool.get_new_blocks(3)) == [0, 1, 2]
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 8
    assert pool.usage == pytest.approx(3 / 11)
    before = pool.free_block_ids()
    assert pool.get_new_blocks(9) is None
    assert pool.free_block_ids() == before == [3, 4, 5, 6, 7, 8, 9, 10]
    assert _ids(pool.get_new_blocks(0)) == []
    pool.check_integrity()


def test_free_puts_cached_blocks_at_back_and_uncached_at_front() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)
    assert blocks is not None
    pool.cache_full_blocks(blocks[:2], [_h("a"), _h("b")])
    pool.free_blocks(reversed(blocks))  # tail first: 3, 2 uncached; 1, 0 cached
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert pool.get_cached_block(_h("a")) is blocks[0]  # freed blocks keep their hash
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 2
    assert pool.usage == 0.0
    pool.check_integrity()


def test_eviction_is_lru_and_evicted_block_loses_hash() -> None:
    pool = BlockPool(4)
    first = pool.get_new_blocks(2)
    assert first is not None
    pool.cache_full_blocks(first, [_h("a"), _h("b")])
    pool.free_blocks(reversed(first))  # freed earlier: evicted earlier
    second = pool.get_new_blocks(2)
    assert _ids(second) == [2, 3]  # never-cached free blocks go before cached ones
    assert second is not None
    pool.cache_full_blocks(second, [_h("c"), _h("d")])
    pool.free_blocks(reversed(second))
    assert pool.free_block_ids() == [1, 0, 3, 2]
    assert _ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(_h("b")) is None and pool.blocks[1].block_hash is None
    assert pool.get_cached_block(_h("a")) is pool.blocks[0]
    assert pool.num_cached_blocks == 3
    pool.check_integrity()


def test_touch_revives_a_free_cached_block_and_shares_a_used_one() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [_h("a"), _h("b")])
    pool.free_blocks([blocks[1]])
    assert pool.free_block_ids() == [2, 3, 1]
    pool.touch([blocks[0], blocks[1]])
    assert [blocks[0].ref_cnt, blocks[1].ref_cnt] == [2, 1]
    assert pool.free_block_ids() == [2, 3]
    pool.free_blocks([blocks[1], blocks[0]])
    assert [blocks[0].ref_cnt, blocks[1].ref_cnt] == [1, 0]
    assert pool.free_block_ids() == [2, 3, 1]
    pool.check_integrity()
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([blocks[1]])


def test_duplicate_content_stays_unhashed_and_hits_keep_their_hash() -> None:
    pool = BlockPool(4)
    a, b = _ids(pool.get_new_blocks(2))
    pool.cache_full_blocks([pool.blocks[a]], [_h("x")])
    pool.cache_full_blocks([pool.blocks[b]], [_h("x")])  # same content computed twice
    assert pool.get_cached_block(_h("x")) is pool.blocks[a]
    assert pool.blocks[b].block_hash is None
    pool.cache_full_blocks([pool.blocks[a]], [_h("y")])  # already cached: unchanged
    assert pool.blocks[a].block_hash == _h("x") and pool.get_cached_block(_h("y")) is None
    pool.check_integrity()


def test_uncache_and_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [_h("a"), _h("b")])
    pool.uncache(blocks[1])
    assert pool.get_cached_block(_h("b")) is None and pool.num_cached_blocks == 1
    assert pool.reset_prefix_cache() is False  # blocks in use: refused
    assert pool.get_cached_block(_h("a")) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in pool.blocks)
    pool.check_integrity()


def test_prefix_caching_disabled_never_caches() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    blocks = pool.get_new_blocks(1)
    assert blocks is not None
    pool.cache_full_blocks(blocks, [_h("a")])
    assert pool.get_cached_block(_h("a")) is None and blocks[0].block_hash is None


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda pool: setattr(pool.blocks[0], "ref_cnt", 1), "referenced"),
        (lambda pool: setattr(pool.blocks[2], "ref_cnt", 0), "lost"),
        (lambda pool: setattr(pool.blocks[1], "block_hash", _h("zz")), "not in map"),
        (lambda pool: pool._cached.pop(_h("a")), "not in map"),
        (lambda pool: setattr(pool.blocks[2], "block_hash", None), "stale"),
    ],
)
def test_check_integrity_detects_corruption(corrupt, message) -> None:
    pool = BlockPool(4)
    used = pool.get_new_blocks(3)
    assert used is not None
    pool.cache_full_blocks(used[1:], [_h("a"), _h("b")])
    pool.free_blocks([used[0], used[1]])  # 0 free, 1 cached-free, 2 in use (cached)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


# ---- block hashes ------------------------------------------------------------------


def test_block_hash_is_deterministic_and_covers_every_input() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(base) == 32
    assert hash_block_tokens(None, (1, 2, 3, 4)) == base  # list or tuple alike
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base  # parent chains in
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != base
    # msgpack keeps the boundaries: moving a token into the extras changes the hash
    assert hash_block_tokens(None, [1, 2, 3], (4,)) != hash_block_tokens(None, [1, 2, 3, 4])


def test_extend_block_hashes_is_incremental_and_skips_partial_blocks() -> None:
    tokens = list(range(10))
    hashes = extend_block_hashes([], tokens, 4, None)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]  # tokens 8, 9: partial
    tokens += [10, 11, 12]
    grown = extend_block_hashes(hashes, tokens, 4, None)
    assert grown is hashes and len(hashes) == 3
    assert hashes == extend_block_hashes([], tokens, 4, None)
    salted = extend_block_hashes([], tokens, 4, "tenant-a")
    assert salted[0] == hash_block_tokens(None, [0, 1, 2, 3], ("tenant-a",))
    assert all(s != h for s, h in zip(salted, hashes))  # the salt reaches every block
    assert extend_block_hashes([], tokens, 4, "") == hashes  # empty salt = no salt


def test_invariant_messages_are_formatted_only_on_failure() -> None:
    """The checks run once per block: a block's repr on every pass would dominate."""
    from kvflow.services.scheduler.block_pool import check_invariant

    class Loud:
        def __repr__(self) -> str:
            raise RuntimeError("formatted although the check passed")

    check_invariant(True, "%s is fine", Loud())
    with pytest.raises(AssertionError, match="block 7 is stale"):
        check_invariant(False, "block %s is %s", 7, "stale")
