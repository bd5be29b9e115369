"""Issue 25 (the memory plan within 2%): what the CUDA caching allocator holds, pool by pool, from
``torch.cuda.memory_snapshot()``: the default pool (weights, the KV pages, every live tensor outside a
graph) apart from each CUDA-graph private pool (the decode graphs' and the piecewise graphs' activations),
each as reserved bytes and the bytes live in it. bench/e2e.py prints it beside "plan vs held", so the plan's
overheads (``qserve.memory.planner``: the graph pools' estimate) can be checked against what each pool took.

Knows: the snapshot's segment dicts (``segment_pool_id``: ``(0, 0)`` for the default pool, another pair
for a graph's private pool; ``total_size`` reserved, ``allocated_size`` live). Must not know: the engine.

    python3 -c "import torch, bench.memory_pools as m; print(m.describe(m.pools(torch.cuda.memory_snapshot())))"
"""

from __future__ import annotations

from collections.abc import Iterable

GIB = 1 << 30
DEFAULT_POOL = (0, 0)


def pools(snapshot: Iterable[dict]) -> dict[tuple[int, int], tuple[int, int]]:
    """``{pool id: (reserved bytes, live bytes)}`` summed over the snapshot's segments; the default pool
    under ``DEFAULT_POOL``."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for segment in snapshot:
        pool = tuple(segment.get("segment_pool_id") or DEFAULT_POOL)
        reserved, live = out.get(pool, (0, 0))
        out[pool] = (reserved + int(segment["total_size"]), live + int(segment["allocated_size"]))
    return out


def describe(by_pool: dict[tuple[int, int], tuple[int, int]]) -> str:
    """One line: the default pool first, then the graph pools largest first, each ``reserved (live) GiB``."""
    order = sorted(by_pool, key=lambda p: (p != DEFAULT_POOL, -by_pool[p][0]))
    parts = []
    for pool in order:
        reserved, live = by_pool[pool]
        name = "default pool" if pool == DEFAULT_POOL else f"graph pool {pool}"
        parts.append(f"{name} {reserved / GIB:.3f} GiB ({live / GIB:.3f} live)")
    graphs = sum(r for p, (r, _) in by_pool.items() if p != DEFAULT_POOL)
    return "; ".join(parts) + f"; graph pools together {graphs / GIB:.3f} GiB"
