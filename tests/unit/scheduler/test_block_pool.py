"""BlockPool: allocation order, LRU free queue, refcounts, cached-block eviction, owner shares."""

from __future__ import annotations

import pytest

from qserve.scheduler.block_pool import BlockPool, OwnerShare


def test_allocate_in_id_order_all_or_nothing() -> None:
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free_blocks == 3
    assert pool.allocate(4) is None  # not enough: nothing taken
    assert pool.num_free_blocks == 3
    assert pool.free_block_ids() == [5, 6, 7]
    assert pool.allocate(0) == []


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    pool.free(reversed(blocks))  # a request's blocks go back tail first
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.allocate(6) == [3, 4, 5, 6, 7, 2]
    assert pool.num_used_blocks == 6


def test_refcounts_and_double_free() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.touch([1])
    assert pool.ref_count(1) == 2
    pool.free([1])
    assert pool.ref_count(1) == 1
    assert pool.free_block_ids() == [2, 3]
    pool.free([1])
    assert pool.ref_count(1) == 0
    assert pool.free_block_ids() == [2, 3, 1]
    with pytest.raises(ValueError, match="block 1 is not allocated"):
        pool.free([1])
    assert pool.num_used_by("default") == 1


def test_cached_free_blocks_stay_findable_until_evicted() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # [0, 1]
    assert pool.cache_block(0, 100)
    assert pool.cache_block(1, 101)
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.lookup(100) == 0 and pool.lookup(101) == 1
    assert pool.allocate(2) == [2, 3]  # uncached blocks first: hashes survive
    assert pool.num_cached_blocks == 2
    assert pool.allocate(1) == [1]  # LRU head: block 1 is evicted, its hash dropped
    assert pool.lookup(101) is None
    assert pool.block_hash(1) is None
    assert pool.lookup(100) == 0
    assert pool.num_cached_blocks == 1


def test_cache_block_keeps_first_holder_of_a_hash() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    assert pool.cache_block(0, 5)
    assert not pool.cache_block(1, 5)  # duplicate content computed twice: the first block wins
    assert pool.lookup(5) == 0
    assert pool.block_hash(1) is None
    pool.reset_prefix_cache()
    assert pool.lookup(5) is None and pool.num_cached_blocks == 0


def test_touch_takes_a_cached_block_out_of_the_middle_of_the_free_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)  # [0, 1, 2]
    pool.cache_block(1, 42)
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.num_used_by("default") == 0
    hit = pool.lookup(42)
    assert hit == 1
    pool.touch([hit])
    assert pool.free_block_ids() == [3, 2, 0]
    assert pool.ref_count(1) == 1
    assert pool.num_used_by("default") == 1
    assert pool.allocate(3) == [3, 2, 0]
    assert pool.lookup(42) == 1  # a block in use is never evicted
    assert pool.allocate(1) is None


def test_owner_accounting_and_max_share() -> None:
    pool = BlockPool(8, shares={"a": OwnerShare(max_blocks=3)})
    assert pool.allocate(4, owner="a") is None
    assert pool.allocate(3, owner="a") == [0, 1, 2]
    assert pool.allocate(1, owner="a") is None  # at its max although 5 blocks are free
    assert pool.num_available("a") == 0
    assert pool.allocate(5, owner="b") == [3, 4, 5, 6, 7]
    assert pool.num_used_by("a") == 3 and pool.num_used_by("b") == 5
    assert pool.owner_of(0) == "a" and pool.owner_of(7) == "b"
    pool.free([1])
    assert pool.num_used_by("a") == 2
    assert pool.allocate(1, owner="a") == [1]


def test_min_share_reserves_blocks_for_its_owner() -> None:
    pool = BlockPool(8, shares={"a": OwnerShare(min_blocks=3)})
    assert pool.num_available("b") == 5
    assert pool.allocate(6, owner="b") is None  # would eat into a's reserved minimum
    assert pool.allocate(5, owner="b") == [0, 1, 2, 3, 4]
    assert pool.allocate(1, owner="b") is None
    assert pool.allocate(1, owner="a") == [5]
    assert pool.num_available("b") == 0  # a still has 2 reserved blocks unmet
    assert pool.allocate(2, owner="a") == [6, 7]
    pool.free([6, 7, 5])
    assert pool.num_available("b") == 0
    assert pool.num_available("a") == 3
    pool.free([0])
    assert pool.num_available("b") == 1  # only the block it gave back beyond a's reservation


def test_capacity_and_share_validation() -> None:
    pool = BlockPool(8, shares={"a": OwnerShare(min_blocks=3), "b": OwnerShare(max_blocks=4)})
    assert pool.capacity("a") == 8
    assert pool.capacity("b") == 4
    assert pool.capacity("c") == 5
    with pytest.raises(ValueError, match="add up to 9 blocks"):
        pool.set_share("c", min_blocks=6)
    with pytest.raises(ValueError, match="min_blocks <= max_blocks"):
        pool.set_share("c", min_blocks=2, max_blocks=1)
    with pytest.raises(ValueError):
        BlockPool(0)
