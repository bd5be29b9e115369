"""Prefix cache through KVCacheManager: shared full blocks, the >=1-token cap, owners, generated blocks."""

from __future__ import annotations

from qserve.scheduler.block_pool import BlockPool
from qserve.scheduler.kv_cache_manager import KVCacheManager
from qserve.scheduler.prefix_cache import (
    hash_block_tokens,
    max_cache_hit_blocks,
    owner_seed,
    update_block_hashes,
)

from .fakes import make_request

BS = 4


def _admit(kv: KVCacheManager, request) -> tuple[list[int], int]:
    """What the scheduler does at admission: hits, then slots for the whole rest of the prompt."""
    hit, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return hit, num_hit


def test_hash_chain_is_incremental_and_names_the_whole_prefix() -> None:
    seed = owner_seed("m")
    req = make_request("a", list(range(10)))
    hashes = update_block_hashes(req, BS, seed)
    h0 = hash_block_tokens(seed, [0, 1, 2, 3])
    assert hashes == [h0, hash_block_tokens(h0, [4, 5, 6, 7])]
    assert req.block_hashes is hashes
    req.output_token_ids += [7, 7]  # 12 tokens: block 2 = [8, 9, 7, 7] spans prompt and outputs
    assert update_block_hashes(req, BS, seed)[2] == hash_block_tokens(hashes[1], [8, 9, 7, 7])
    other = make_request("b", [9, 1, 2, 3, 4, 5, 6, 7])
    assert update_block_hashes(other, BS, seed)[1] != hashes[1]  # same tokens, different parent


def test_two_prompts_share_their_two_common_full_blocks() -> None:
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    assert _admit(kv, a) == ([], 0)
    assert kv.block_table("a") == [0, 1, 2]
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert _admit(kv, b) == ([0, 1], 8)
    assert kv.block_table("b") == [0, 1, 3]
    assert [pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert kv.num_prefix_hits == 8 and kv.num_prefix_queries == 21
    # Freed blocks stay cached (tail first in the free queue) and are hit again.
    kv.free(a)
    kv.free(b)
    assert pool.free_block_ids()[-4:] == [2, 3, 1, 0]
    c = make_request("c", list(range(9)))
    assert _admit(kv, c) == ([0, 1], 8)
    assert kv.block_table("c") == [0, 1, 4]


def test_cap_always_leaves_one_token_to_compute() -> None:
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BS)
    _admit(kv, make_request("a", list(range(12))))  # 3 full blocks cached: [0, 1, 2]
    assert pool.num_cached_blocks == 3
    assert max_cache_hit_blocks(8, BS) == 1 and max_cache_hit_blocks(9, BS) == 2
    same = make_request("same", list(range(12)))  # fully cached, block aligned: last block recomputed
    assert kv.get_computed_blocks(same) == ([0, 1], 8)
    shorter = make_request("shorter", list(range(8)))
    assert kv.get_computed_blocks(shorter) == ([0], 4)
    one_more = make_request("one_more", list(range(13)))
    assert kv.get_computed_blocks(one_more) == ([0, 1, 2], 12)


def test_hashes_differ_per_owner_so_models_never_share_blocks() -> None:
    pool = BlockPool(16)
    kv_a = KVCacheManager(pool, BS, owner="model-a")
    kv_b = KVCacheManager(pool, BS, owner="model-b")
    assert kv_a.hash_seed != kv_b.hash_seed
    _admit(kv_a, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)))
    assert _admit(kv_b, b) == ([], 0)
    assert kv_b.block_table("b") == [3, 4, 5]
    assert b.block_hashes[0] != kv_a.pool.block_hash(0)
    assert pool.num_used_by("model-a") == 3 and pool.num_used_by("model-b") == 3
    assert kv_a.get_computed_blocks(make_request("a2", list(range(9)))) == ([0, 1], 8)


def test_blocks_filled_by_generated_tokens_are_cached() -> None:
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BS)
    req = make_request("a", [1, 2, 3, 4, 5, 6])
    _admit(kv, req)
    assert kv.block_table("a") == [0, 1]
    assert pool.num_cached_blocks == 1  # block 1 holds [5, 6] only
    for _ in range(2):  # two decode steps: sampled 7 then its KV computed
        req.output_token_ids.append(7)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        kv.cache_full_blocks(req)
    assert req.num_computed_tokens == 8
    assert pool.lookup(req.block_hashes[1]) == 1  # [5, 6, 7, 7] filled by outputs is cached
    follow_up = make_request("b", [1, 2, 3, 4, 5, 6, 7, 7, 9])
    assert kv.get_computed_blocks(follow_up) == ([0, 1], 8)


def test_prompt_logprobs_requests_never_hit_and_disabled_cache_never_hits() -> None:
    pool = BlockPool(16)
    kv = KVCacheManager(pool, BS)
    _admit(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("lp", list(range(9)), prompt_logprobs=1)) == ([], 0)
    assert kv.get_computed_blocks(make_request("lp0", list(range(9)), prompt_logprobs=0)) == ([], 0)
    off = KVCacheManager(BlockPool(16), BS, enable_prefix_caching=False)
    _admit(off, make_request("a", list(range(9))))
    assert off.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert off.pool.num_cached_blocks == 0


def test_allocate_slots_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    a = make_request("a", list(range(9)))
    _admit(kv, a)  # [0, 1, 2]; blocks 0, 1 cached
    kv.free(a)  # free queue [3, 2, 1, 0], cached 0 and 1 still findable
    b = make_request("b", list(range(8)) + [60] * 9)  # 17 tokens: hits [0, 1], needs 3 more blocks
    hit, num_hit = kv.get_computed_blocks(b)
    assert (hit, num_hit) == ([0, 1], 8)
    assert not kv.allocate_slots(b, 9, hit)  # 2 revived + 3 new > 4 free
    assert kv.block_table("b") == []
    assert pool.free_block_ids() == [3, 2, 1, 0] and pool.ref_count(0) == 0
    assert kv.allocate_slots(b, 8, hit)  # 16 tokens: 2 revived + 2 new
    assert kv.block_table("b") == [0, 1, 3, 2]
    assert pool.num_free_blocks == 0
