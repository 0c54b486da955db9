"""KVCacheManager: all-or-nothing allocation, capacity accounting, freeing order, zeroing list."""

from __future__ import annotations

import pytest

from fleetserve.engine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from tests.factories import make_request


def make_manager(
    num_blocks: int = 11, *, enable_caching: bool = True, max_model_len: int = 2048
) -> KVCacheManager:
    return KVCacheManager(num_blocks, 16, enable_caching, max_model_len)


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def test_prompt_allocation_caches_full_blocks_and_records_new_ids() -> None:
    manager = make_manager()
    request = make_request("r", list(range(40)))
    blocks = manager.allocate_slots(request, 40)
    assert blocks is not None and blocks.get_block_ids() == [1, 2, 3]
    assert manager.get_block_ids("r") == [1, 2, 3]
    hashes = [b.block_hash for b in manager.req_to_blocks["r"]]
    assert hashes == [request.block_hashes[0], request.block_hashes[1], None]
    assert manager.take_new_block_ids() == [1, 2, 3]
    assert manager.take_new_block_ids() == []
    assert manager.num_free_blocks == 7 and manager.usage == 0.3
    manager.block_pool.check_integrity()


def test_decode_appends_a_block_only_when_the_last_one_is_full() -> None:
    manager = make_manager()
    request = make_request("r", list(range(47)))
    assert manager.allocate_slots(request, 47) is not None
    request.num_computed_tokens = 47
    request.append_output_token_ids([5])  # 48 tokens: the 3rd block fills
    new = manager.allocate_slots(request, 1)
    assert new is not None and new.get_block_ids() == []
    assert manager.req_to_blocks["r"][2].block_hash == request.block_hashes[2]
    request.num_computed_tokens = 48
    request.append_output_token_ids([6])
    new = manager.allocate_slots(request, 1)
    assert new is not None and new.get_block_ids() == [4]
    assert manager.get_block_ids("r") == [1, 2, 3, 4]  # append-only block table
    assert manager.take_new_block_ids() == [1, 2, 3, 4]


def test_failed_allocation_leaves_the_pool_unchanged() -> None:
    manager = make_manager(5)
    r1 = make_request("r1", list(range(40)))
    r2 = make_request("r2", list(range(100, 140)))
    assert manager.allocate_slots(r1, 40) is not None
    before = free_ids(manager)
    assert manager.allocate_slots(r2, 40) is None
    assert free_ids(manager) == before == [4]
    assert "r2" not in manager.req_to_blocks
    assert manager.take_new_block_ids() == [1, 2, 3]
    manager.block_pool.check_integrity()


def test_reviving_free_hit_blocks_counts_against_free_capacity() -> None:
    manager = make_manager(5)
    r0 = make_request("r0", list(range(1000, 1010)))
    assert manager.allocate_slots(r0, 10) is not None  # holds block 1
    r1 = make_request("r1", list(range(33)))
    assert manager.allocate_slots(r1, 33) is not None  # blocks 2, 3 (hashed), 4
    r1.num_computed_tokens = 33
    manager.free(r1)
    assert free_ids(manager) == [4, 3, 2]

    r2 = make_request("r2", list(range(32)) + list(range(500, 530)))  # 62 tokens: 4 blocks
    hit, num_hit = manager.get_computed_blocks(r2)
    assert hit.get_block_ids() == [2, 3] and num_hit == 32
    # 2 new blocks are needed and 3 are free, but reviving the 2 hit blocks uses 2 of them.
    assert manager.allocate_slots(r2, 30, num_hit, hit) is None
    assert free_ids(manager) == [4, 3, 2]
    assert [b.ref_cnt for b in hit.blocks] == [0, 0]
    manager.block_pool.check_integrity()


def test_prefix_hit_is_shared_and_new_blocks_follow_it() -> None:
    manager = make_manager(5)
    r1 = make_request("r1", list(range(33)))
    assert manager.allocate_slots(r1, 33) is not None
    r1.num_computed_tokens = 33
    manager.free(r1)
    assert free_ids(manager) == [3, 4, 2, 1]
    r2 = make_request("r2", list(range(32)) + list(range(500, 530)))
    hit, num_hit = manager.get_computed_blocks(r2)
    assert manager.allocate_slots(r2, 30, num_hit, hit, watermark_blocks=1) is None
    new = manager.allocate_slots(r2, 30, num_hit, hit)
    assert new is not None and new.get_block_ids() == [3, 4]
    assert manager.get_block_ids("r2") == [1, 2, 3, 4]
    assert manager.take_new_block_ids() == [1, 2, 3, 4]  # block 3 was reused: listed once
    assert manager.num_free_blocks == 0
    manager.block_pool.check_integrity()


def test_watermark_keeps_blocks_free() -> None:
    manager = make_manager(5)
    request = make_request("r", list(range(40)))  # 3 of the 4 usable blocks
    assert manager.allocate_slots(request, 40, watermark_blocks=2) is None
    assert manager.allocate_slots(request, 40, watermark_blocks=1) is not None


def test_full_sequence_must_fit_counts_prompt_plus_max_tokens() -> None:
    manager = make_manager(5)  # 4 usable blocks = 64 tokens
    request = make_request("r", list(range(20)), max_tokens=50)  # 70 tokens: 5 blocks
    assert manager.allocate_slots(request, 20, full_sequence_must_fit=True) is None
    assert manager.num_free_blocks == 4
    blocks = manager.allocate_slots(request, 20)
    assert blocks is not None and blocks.get_block_ids() == [1, 2]  # only the chunk's blocks

    capped = make_manager(5, max_model_len=64)  # max_model_len caps the sequence at 4 blocks
    blocks = capped.allocate_slots(request, 20, full_sequence_must_fit=True)
    assert blocks is not None and blocks.get_block_ids() == [1, 2]


def test_lookahead_and_max_model_len_cap_the_slots() -> None:
    manager = make_manager()
    request = make_request("r", list(range(16)))
    blocks = manager.allocate_slots(request, 16, num_lookahead_tokens=1)
    assert blocks is not None and len(blocks.blocks) == 2
    capped = make_manager(max_model_len=16)
    blocks = capped.allocate_slots(request, 16, num_lookahead_tokens=4)
    assert blocks is not None and len(blocks.blocks) == 1
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(request, 0)


def test_free_releases_in_reverse_so_the_tail_is_evicted_first() -> None:
    manager = make_manager()
    request = make_request("r", list(range(53)))  # 3 full blocks + 5 tokens
    assert manager.allocate_slots(request, 53) is not None
    request.num_computed_tokens = 53
    manager.free(request)
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert manager.get_block_ids("r") == []
    manager.block_pool.check_integrity()


def test_free_unindexes_blocks_whose_kv_was_never_written() -> None:
    manager = make_manager()
    request = make_request("r", list(range(40)))
    assert manager.allocate_slots(request, 40) is not None  # indexed for this step
    manager.free(request)  # preempted before the step ran: nothing was computed
    assert free_ids(manager)[:4] == [1, 2, 3, 4]  # unindexed, so back at the head
    assert manager.get_computed_blocks(make_request("again", list(range(40))))[1] == 0

    request = make_request("r", list(range(40)))
    assert manager.allocate_slots(request, 40) is not None
    request.num_computed_tokens = 20  # block 0 written, block 1 only half
    manager.free(request)
    assert manager.get_computed_blocks(make_request("again", list(range(40))))[1] == 16
    manager.block_pool.check_integrity()


def test_caching_disabled_never_hits() -> None:
    manager = make_manager(enable_caching=False)
    request = make_request("r", list(range(40)))
    assert manager.allocate_slots(request, 40) is not None
    request.num_computed_tokens = 40
    manager.free(request)
    assert manager.get_computed_blocks(make_request("b", list(range(40)))) == (KVCacheBlocks(), 0)
    assert manager.prefix_cache_queries == 0


def test_kv_cache_blocks_add() -> None:
    manager = make_manager()
    a = manager.allocate_slots(make_request("a", [1]), 1)
    b = manager.allocate_slots(make_request("b", [2]), 1)
    assert a is not None and b is not None
    assert (a + b).get_block_ids() == [1, 2]
