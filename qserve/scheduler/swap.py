"""Swap preemption, as the scheduler sees it: the slots of a host KV pool, which swapped request
holds which, and the estimate that picks swap or recompute in ``auto`` mode.

Knows: host slot ids ``0 .. num_slots-1`` (one slot holds one KV block of the model: every layer's
K and V), which are free, each swapped request's slots (logical block i of the request lives in
slot ``slots[i]``), the bytes of a block, the host link's bandwidth and the seconds a recomputed
token costs. Must not know: torch or tensors (the runner's ``KVSwapper`` holds the host memory and
does the copies), queues, requests' tokens.

Slots are handed out lowest-id first, so a request's slots (and a step's) are mostly contiguous:
the runner copies each contiguous run of slots with one copy per cache tensor.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap", "auto")
# auto's defaults until the engine measures them: a pinned PCIe 4.0 x16 copy (~20 GB/s) and a
# per-token prefill cost of 50 us (a 14B model on one H100-class GPU); the engine replaces the
# bandwidth with a measured one at start-up and the token cost with the one its steps show.
DEFAULT_SWAP_BANDWIDTH_BYTES_PER_S = 20e9
DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN = 50e-6


def check_preemption_mode(mode: object) -> str:
    """``mode`` if it is a preemption mode; else a ValueError naming the flag and the choices."""
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; got {mode!r}")
    return mode  # type: ignore[return-value]


def check_tensor_parallel_preemption(mode: str, tensor_parallel_size: int, flag: str = "preemption_mode") -> None:
    """Tensor-parallel engines preempt by recompute only (the KV copies are per rank): a ValueError
    naming ``flag`` otherwise, raised before any worker process starts."""
    if mode != "recompute" and tensor_parallel_size > 1:
        raise ValueError(f"{flag} {mode!r} is not supported with tensor parallelism; use 'recompute'")


class HostSwapSpace:
    """Free host slots (a min-heap: lowest id first) and the slots each swapped request holds."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host swap space needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # a heap (sorted is a valid heap)
        self._tables: dict[str, list[int]] = {}
        self._released: list[int] = []  # taken by swap-ins this step; free again at end_step()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is on the host now."""
        return len(self._tables)

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def swap_out(self, request_id: str, num_blocks: int) -> list[int] | None:
        """Slots for ``num_blocks`` blocks of ``request_id`` (ascending), or None (nothing taken)
        when fewer are free: the caller then preempts by recompute."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} is already swapped out")
        if num_blocks < 1 or num_blocks > len(self._free):
            return None
        slots = [heapq.heappop(self._free) for _ in range(num_blocks)]
        self._tables[request_id] = slots
        return slots

    def swap_in(self, request_id: str) -> list[int]:
        """The request's slots, to copy back now. They stay taken until ``end_step()``: no later
        decision of the same step may reuse a slot whose copy back it has not made yet."""
        slots = self._tables.pop(request_id)
        self._released.extend(slots)
        return slots

    def release(self, request_id: str) -> None:
        """Drop a swapped request's slots (finished or aborted while swapped); no-op otherwise."""
        for slot in self._tables.pop(request_id, ()):
            heapq.heappush(self._free, slot)

    def end_step(self) -> None:
        for slot in self._released:
            heapq.heappush(self._free, slot)
        self._released.clear()


@dataclass(slots=True)
class SwapCost:
    """``auto`` mode's estimate: swap when moving the KV out and back in is cheaper than
    recomputing it. swap = 2 x blocks x ``block_bytes`` / ``bandwidth_bytes_per_s``; recompute =
    computed tokens x ``recompute_seconds_per_token``. Mutable: the engine updates both numbers
    from measurements (start-up copy, prefill steps)."""

    block_bytes: int
    bandwidth_bytes_per_s: float = DEFAULT_SWAP_BANDWIDTH_BYTES_PER_S
    recompute_seconds_per_token: float = DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_bytes / self.bandwidth_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.recompute_seconds_per_token

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)
