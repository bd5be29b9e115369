"""Issue 25 (the memory plan within 2%): what the CUDA caching allocator holds, pool by pool, from
``torch.cuda.memory_snapshot()``: the default pool (weights, the KV pages, every live tensor outside a
graph) apart from each CUDA-graph private pool (the decode graphs' and the piecewise graphs' activations),
each as reserved bytes and the bytes live in it. bench/e2e.py prints it beside "plan vs held", so the plan's
overheads (``qserve.memory.planner``: the graph pools' estimate) can be checked against what each pool took.

Knows: the snapshot's segment dicts (``segment_pool_id``: ``(0, 0)`` for the default pool, ``(n, 0)`` for a
CUDA graph's private pool, ``(0, n)`` for a pool made with ``torch.cuda.MemPool``: the engine's weights,
``qserve.model.loader``; ``total_size`` reserved, ``allocated_size`` live; ``stream``, ``segment_type``
and the ``blocks`` with their ``state``). Must not know: the engine.

``default_pool_parts`` splits the default pool by stream and segment type (small: allocations under 1 MB)
and gives each part's free (inactive) bytes and largest free block: where the bytes held past the live
ones sit when ``empty_cache`` did not return them.

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


def is_graph_pool(pool: tuple[int, int]) -> bool:
    """A CUDA graph's pool (torch numbers them ``(n, 0)``; a ``torch.cuda.MemPool`` is ``(0, n)``)."""
    return pool[0] != 0 and pool[1] == 0


def describe(by_pool: dict[tuple[int, int], tuple[int, int]]) -> str:
    """One line: the default pool first, then the other pools largest first (a ``torch.cuda.MemPool``, as the
    weights' pool, is a "MemPool"), each ``reserved (live) GiB``; then the graph pools' sum."""
    order = sorted(by_pool, key=lambda p: (p != DEFAULT_POOL, -by_pool[p][0]))
    parts = []
    for pool in order:
        reserved, live = by_pool[pool]
        name = (
            "default pool" if pool == DEFAULT_POOL else f"{'graph pool' if is_graph_pool(pool) else 'MemPool'} {pool}"
        )
        parts.append(f"{name} {reserved / GIB:.3f} GiB ({live / GIB:.3f} live)")
    graphs = sum(r for p, (r, _) in by_pool.items() if is_graph_pool(p))
    return "; ".join(parts) + f"; graph pools together {graphs / GIB:.3f} GiB"


def default_pool_parts(snapshot: Iterable[dict]) -> str:
    """One line: the default pool's segments by ``(stream, segment type)``, largest first, each as
    ``reserved (live, free in N blocks, largest free) GiB``; a free block is one whose state is inactive."""
    parts: dict[tuple[int, str], list[int]] = {}  # (stream, type) -> [reserved, live, free, free blocks, largest]
    for segment in snapshot:
        if tuple(segment.get("segment_pool_id") or DEFAULT_POOL) != DEFAULT_POOL:
            continue
        key = (int(segment.get("stream", 0)), str(segment.get("segment_type", "large")))
        acc = parts.setdefault(key, [0, 0, 0, 0, 0])
        acc[0] += int(segment["total_size"])
        acc[1] += int(segment["allocated_size"])
        for block in segment.get("blocks", ()):
            if block.get("state") == "inactive":
                acc[2] += int(block["size"])
                acc[3] += 1
                acc[4] = max(acc[4], int(block["size"]))
    order = sorted(parts, key=lambda k: -parts[k][0])
    return "; ".join(
        f"stream {stream} {kind} {r / GIB:.3f} GiB ({live / GIB:.3f} live, {free / GIB:.3f} free in {n} blocks, "
        f"largest {big / GIB:.3f})"
        for (stream, kind), (r, live, free, n, big) in ((k, parts[k]) for k in order)
    )
