"""Issue 25 (the plan within 2%): which allocations leave the free holes that the default pool still holds
after a start-up and ``empty_cache`` (the twenty-fifth session's "default pool by stream" row: 0.84 GiB in 75
holes of about 11 MB on the 14B engine's main stream).

It records the caching allocator's history through a start-up (``torch.cuda.memory._record_memory_history``),
then takes the snapshot and, for each free (inactive) block of the default pool, names the allocation that
last lay over it: the Python frames of its ``alloc`` event, grouped by the innermost frame in qserve's own
code. It also says whether the allocator unmapped any page of the hole after that allocation was freed
(expandable segments give whole free pages back on ``empty_cache``; a hole that stays mapped is one it would
not or could not give back).

Knows: the snapshot's dict (``segments`` with ``blocks``: ``address``, ``size``, ``state``;
``device_traces``: ``action``, ``addr``, ``size``, ``frames``). Must not know: the engine's internals (the
command builds one through ``qserve.LLM``, as bench/e2e.py does).

    python3 bench/memory_history.py --out history.md                    # the 14B-shaped GPTQ, 24 GiB budget
    python3 bench/memory_history.py --tmp /tmp/qbd --reuse-checkpoint    # bench/e2e.py's checkpoint
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import memory_pools  # noqa: E402
from bench.memory_pools import DEFAULT_POOL  # noqa: E402

MB = 1 << 20
GIB = 1 << 30
# Where qserve's own frames live: the innermost of them names an allocation.
OWN_CODE = ("/qserve/", "/loaders/", "/quant_kernels/", "/bench/")


@dataclass
class Hole:
    """One free block of the default pool."""

    address: int
    size: int
    stream: int
    last_alloc: dict | None = None  # the last alloc event over any byte of it
    freed: bool = False  # a free_completed over it since that allocation
    unmapped_after_free: bool = False  # a segment_unmap over it after that free

    @property
    def end(self) -> int:
        return self.address + self.size


def free_holes(snapshot: dict, min_bytes: int = MB) -> list[Hole]:
    """The default pool's inactive blocks of at least ``min_bytes``, by address."""
    holes = []
    for segment in snapshot["segments"]:
        if tuple(segment.get("segment_pool_id") or DEFAULT_POOL) != DEFAULT_POOL:
            continue
        address = int(segment["address"])
        for block in segment.get("blocks", ()):
            size = int(block["size"])
            if block.get("state") == "inactive" and size >= min_bytes:
                holes.append(Hole(int(block.get("address", address)), size, int(segment.get("stream", 0))))
            address += size
    return sorted(holes, key=lambda h: h.address)


def attribute(holes: Sequence[Hole], trace: Iterable[dict]) -> None:
    """Fill each hole's ``last_alloc`` (the last ``alloc`` event whose range meets the hole) and whether a
    ``segment_unmap`` met it after that allocation was freed; ``trace`` in the order the allocator wrote it."""
    starts = [h.address for h in holes]
    for event in trace:
        action = event.get("action")
        if action not in ("alloc", "free_completed", "segment_unmap"):
            continue
        lo, hi = int(event["addr"]), int(event["addr"]) + int(event["size"])
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(holes) and holes[i].address < hi:
            hole = holes[i]
            if hole.end > lo:
                if action == "alloc":
                    hole.last_alloc, hole.freed, hole.unmapped_after_free = event, False, False
                elif action == "free_completed":
                    hole.freed = True
                elif hole.freed:  # unmapped after the last occupant was freed
                    hole.unmapped_after_free = True
            i += 1


def own_frames(frames: Sequence[dict], depth: int = 3) -> str:
    """The innermost ``depth`` frames in qserve's code, innermost first, as ``file:line name``."""
    picked = []
    for frame in frames:
        name = str(frame.get("filename", ""))
        if any(part in name for part in OWN_CODE):
            short = name[max(name.rfind(part) for part in OWN_CODE if part in name) + 1 :]
            picked.append(f"{short}:{frame.get('line')} {frame.get('name')}")
            if len(picked) == depth:
                break
    return " < ".join(picked) or "(no qserve frame)"


def summarize(holes: Sequence[Hole], depth: int = 3) -> list[tuple[str, int, int, int, int]]:
    """``[(where, holes, bytes, largest hole, holes still mapped after the free)]``, most bytes first;
    ``where`` is the last occupant's qserve frames (or why there is none)."""
    groups: dict[str, list[int]] = {}
    for hole in holes:
        if hole.last_alloc is None:
            where = "(no alloc over it in the recorded history)"
        else:
            where = own_frames(hole.last_alloc.get("frames", ()), depth)
        acc = groups.setdefault(where, [0, 0, 0, 0])
        acc[0] += 1
        acc[1] += hole.size
        acc[2] = max(acc[2], hole.size)
        acc[3] += 0 if hole.unmapped_after_free else 1
    rows = [(where, n, total, big, mapped) for where, (n, total, big, mapped) in groups.items()]
    return sorted(rows, key=lambda r: -r[2])


def table(rows: Sequence[tuple[str, int, int, int, int]]) -> str:
    lines = [
        "| last occupant (innermost qserve frames) | holes | MiB | largest MiB | no unmap after the free |",
        "|---|---:|---:|---:|---:|",
    ]
    for where, n, total, big, mapped in rows:
        lines.append(f"| `{where}` | {n} | {total / MB:.1f} | {big / MB:.1f} | {mapped} |")
    return "\n".join(lines)


def main() -> None:
    import torch

    from bench.e2e import QWEN14B, write_random_gptq
    from qserve import LLM, SamplingParams
    from qserve.runner.cuda_allocator import prefer_expandable_segments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="memory_history.md")
    parser.add_argument("--tmp", default="/tmp/qserve-bench")
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--reuse-checkpoint", action="store_true")
    parser.add_argument("--max-entries", type=int, default=1_000_000, help="the allocator's trace ring")
    parser.add_argument("--min-hole-mib", type=float, default=1.0)
    parser.add_argument("--depth", type=int, default=3, help="qserve frames a row names")
    args = parser.parse_args()
    prefer_expandable_segments()
    ckpt = Path(args.tmp) / "qwen2.5-14b-gptq"
    if not (args.reuse_checkpoint and (ckpt / "config.json").is_file()):
        write_random_gptq(ckpt, QWEN14B)
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    start = time.perf_counter()
    llm = LLM(str(ckpt), gpu_memory_budget=args.budget, max_model_len=4096, max_num_seqs=256)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1))
    torch.cuda.empty_cache()
    startup = time.perf_counter() - start
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    holes = free_holes(snapshot, int(args.min_hole_mib * MB))
    attribute(holes, trace)
    held = torch.cuda.memory_reserved()
    free = sum(h.size for h in holes)
    head = (
        f"Start-up with the allocator's history recorded: {startup:.1f} s, {len(trace):,} trace events "
        f"(ring {args.max_entries:,}{': full, the oldest lost' if len(trace) >= args.max_entries else ''}). "
        f"Held after empty_cache {held / GIB:.3f} GiB; the default pool's free blocks of >= {args.min_hole_mib} MiB: "
        f"{len(holes)}, {free / GIB:.3f} GiB. Held by pool: {memory_pools.describe(memory_pools.pools(snapshot['segments']))}."
    )
    text = head + "\n\n" + table(summarize(holes, args.depth)) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
