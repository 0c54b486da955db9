"""BlockPool: null block, free-queue order (the eviction policy), ref counts and the hash index."""

from __future__ import annotations

import pytest

from fleetserve.common.block_hash import BlockHash
from fleetserve.engine.core.block_pool import (
    BlockHashToBlockMap,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)
from tests.factories import make_request


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_removes_from_the_middle_and_appends_at_both_ends() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 3, 4]
    queue.appendleft(blocks[2])
    queue.append(queue.popleft())
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 3, 4, 2]
    assert queue.num_free_blocks == 5
    for _ in range(5):
        queue.popleft()
    with pytest.raises(ValueError, match="No free blocks"):
        queue.popleft()
    queue.append(blocks[0])
    with pytest.raises(AssertionError, match="already in the free queue"):
        queue.append(blocks[0])


def test_null_block_is_never_allocated() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    blocks = pool.get_new_blocks(4)
    assert ids(blocks) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(blocks))
    assert 0 not in free_ids(pool)
    # The null block is ignored by touch and free (it may pad block tables).
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and 0 not in free_ids(pool)
    pool.check_integrity()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_get_new_blocks_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [1, 2, 3]
    assert [b.ref_cnt for b in pool.get_new_blocks(2)] == [1, 1]


def test_unhashed_freed_block_is_reused_first_and_cached_blocks_evict_lru() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    request = make_request("r", list(range(48)))
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    pool.cache_full_blocks(request, blocks, 0, 2, 16)  # blocks 1, 2 hashed; 3 not
    pool.free_blocks(reversed(blocks))
    # 3 (unhashed) to the head; 2 then 1 (hashed) to the tail: the request's tail evicts first.
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    assert pool.get_cached_block(request.block_hashes[1]) is blocks[1]
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(request.block_hashes[1]) is None  # evicted
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(request.block_hashes[0]) is None
    pool.check_integrity()


def test_touch_revives_a_free_block_and_a_shared_block_outlives_one_owner() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    request = make_request("r", list(range(32)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 16)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1]

    hit = pool.get_cached_block(request.block_hashes[0])
    assert hit is blocks[0]
    pool.touch([hit])  # a second request hits block 1 while it is free
    assert free_ids(pool) == [3, 4, 5, 2] and hit.ref_cnt == 1

    pool.touch([hit])  # and a third one shares it
    pool.free_blocks([hit])  # one owner finishes
    assert hit.ref_cnt == 1 and 1 not in free_ids(pool)
    assert pool.get_cached_block(request.block_hashes[0]) is hit
    pool.free_blocks([hit])
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    pool.check_integrity()


def test_duplicate_hashes_are_tracked_separately() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    r1 = make_request("r1", list(range(16)))
    r2 = make_request("r2", list(range(16)))
    b1, b2 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(r1, b1, 0, 1, 16)
    pool.cache_full_blocks(r2, b2, 0, 1, 16)
    index = pool.cached_block_hash_to_block
    assert len(index) == 1 and index.num_blocks() == 2
    assert ids(index.get_all_blocks(r1.block_hashes[0])) == [1, 2]
    pool.free_blocks(b1)
    pool.free_blocks(b2)
    assert free_ids(pool) == [3, 4, 5, 1, 2]
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 1]  # evicts block 1's copy only
    assert pool.get_cached_block(r1.block_hashes[0]) is b2[0]
    pool.get_new_blocks(1)
    assert pool.get_cached_block(r1.block_hashes[0]) is None
    pool.check_integrity()


def test_recaching_a_block_under_a_new_hash_drops_the_old_entry() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    old = make_request("old", list(range(16)))
    new = make_request("new", list(range(1, 17)))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(old, blocks, 0, 1, 16)
    pool.cache_full_blocks(old, blocks, 0, 1, 16)  # same hash again: no duplicate entry
    assert pool.cached_block_hash_to_block.num_blocks() == 1
    pool.cache_full_blocks(new, blocks, 0, 1, 16)
    assert pool.get_cached_block(old.block_hashes[0]) is None
    assert pool.get_cached_block(new.block_hashes[0]) is blocks[0]
    pool.check_integrity()


def test_hash_map_keeps_the_rest_when_one_duplicate_is_removed() -> None:
    index = BlockHashToBlockMap()
    h = BlockHash(b"h" * 32)
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    index.insert(h, a)
    index.insert(h, a)
    assert index.num_blocks() == 1
    index.insert(h, b)
    index.insert(h, c)
    assert index.pop(h, 2) is b
    assert index.get_all_blocks(h) == [a, c]
    assert index.pop(h, 9) is None
    assert index.pop(h, 1) is a
    assert index.get_one_block(h) is c
    assert index.pop(h, 5) is None and index.get_one_block(h) is c
    assert index.pop(h, 3) is c and len(index) == 0


def test_caching_disabled_indexes_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    request = make_request("r", list(range(16)))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1, 16)
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert blocks[0].block_hash is None


def test_usage_reset_and_integrity() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    request = make_request("r", list(range(16)))
    blocks = pool.get_new_blocks(1)
    assert pool.get_usage() == 0.25
    pool.cache_full_blocks(request, blocks, 0, 1, 16)
    assert pool.reset_prefix_cache() is False  # a block is owned
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert blocks[0].block_hash is None
    pool.check_integrity()
    pool.blocks[2].ref_cnt = 1  # corrupt: owned but still in the free queue
    with pytest.raises(AssertionError, match="block 2"):
        pool.check_integrity()
