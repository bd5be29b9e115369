"""bench/memory_pools.py: the caching allocator's snapshot summed per pool (the default pool apart from each
CUDA graph's private pool), reserved and live bytes, as bench/e2e.py prints them beside "plan vs held"."""

from __future__ import annotations

from bench.memory_pools import DEFAULT_POOL, GIB, describe, pools

SNAPSHOT = [  # torch.cuda.memory_snapshot()'s segment dicts, the fields the summary reads
    {"segment_pool_id": (0, 0), "total_size": 8 * GIB, "allocated_size": 7 * GIB},
    {"segment_pool_id": (0, 0), "total_size": 2 * GIB, "allocated_size": 2 * GIB},
    {"segment_pool_id": (1, 0), "total_size": GIB, "allocated_size": GIB // 4},  # the decode graphs
    {"segment_pool_id": (1, 0), "total_size": GIB // 2, "allocated_size": 0},
    {"segment_pool_id": (2, 0), "total_size": 2 * GIB, "allocated_size": 0},  # another capture's pool
]


def test_pools_sum_reserved_and_live_bytes_per_pool() -> None:
    by_pool = pools(SNAPSHOT)
    assert by_pool == {DEFAULT_POOL: (10 * GIB, 9 * GIB), (1, 0): (GIB + GIB // 2, GIB // 4), (2, 0): (2 * GIB, 0)}
    text = describe(by_pool)
    # the default pool first, then the graph pools largest first, and their sum
    assert text.startswith("default pool 10.000 GiB (9.000 live); graph pool (2, 0) 2.000 GiB (0.000 live); ")
    assert "graph pool (1, 0) 1.500 GiB (0.250 live)" in text
    assert text.endswith("graph pools together 3.500 GiB")
