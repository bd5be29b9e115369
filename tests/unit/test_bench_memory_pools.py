"""bench/memory_pools.py: the caching allocator's snapshot summed per pool (the default pool apart from each
CUDA graph's private pool), reserved and live bytes, as bench/e2e.py prints them beside "plan vs held"."""

from __future__ import annotations

from bench.memory_pools import DEFAULT_POOL, GIB, default_pool_parts, describe, pools

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


def test_a_mempool_is_named_apart_from_the_graph_pools() -> None:
    """torch numbers a torch.cuda.MemPool (0, n) (the weights' pool) and a graph's pool (n, 0): the first is not
    summed with the graphs (the twenty-sixth session's first rows called the weights a graph pool)."""
    text = describe(pools(SNAPSHOT + [{"segment_pool_id": (0, 1), "total_size": 6 * GIB, "allocated_size": 6 * GIB}]))
    assert "; MemPool (0, 1) 6.000 GiB (6.000 live); graph pool (2, 0)" in text
    assert text.endswith("graph pools together 3.500 GiB")


def test_default_pool_parts_by_stream_and_segment_type() -> None:
    """The default pool's segments summed by (stream, segment type), with their free (inactive) blocks; graph
    pools left out."""
    mib = 1 << 20
    free = {"state": "inactive"}
    snapshot = [
        {"segment_pool_id": (0, 0), "stream": 0, "segment_type": "large", "total_size": 8 * GIB,
         "allocated_size": 7 * GIB, "blocks": [{"state": "active_allocated", "size": 7 * GIB},
                                              free | {"size": GIB // 2}, free | {"size": GIB // 2}]},
        {"segment_pool_id": (0, 0), "stream": 7, "segment_type": "large", "total_size": GIB,
         "allocated_size": 0, "blocks": [free | {"size": GIB}]},
        {"segment_pool_id": (0, 0), "stream": 0, "segment_type": "small", "total_size": 2 * mib,
         "allocated_size": mib, "blocks": [{"state": "active_allocated", "size": mib}, free | {"size": mib}]},
        {"segment_pool_id": (1, 0), "stream": 0, "segment_type": "large", "total_size": GIB,
         "allocated_size": 0, "blocks": [free | {"size": GIB}]},  # a graph's pool: not the default one
    ]  # fmt: skip
    assert default_pool_parts(snapshot) == (
        "stream 0 large 8.000 GiB (7.000 live, 1.000 free in 2 blocks, largest 0.500); "
        "stream 7 large 1.000 GiB (0.000 live, 1.000 free in 1 blocks, largest 1.000); "
        "stream 0 small 0.002 GiB (0.001 live, 0.001 free in 1 blocks, largest 0.001)"
    )
