"""Swap preemption, memory side: a host copy of one model's KV pages and the batched copies
between it and the device caches.

Knows: the model's per-layer (key, value) cache tensors (each ``[num_blocks, block_size,
num_kv_heads, head_size]``, possibly strided views into a shared page buffer), the host pool, and
how to apply a step's ``blocks_to_swap_out`` / ``blocks_to_swap_in``. Must not know: requests,
scheduling policy, why a block moves (the scheduler decides, ``qserve.scheduler.swap``).

Host pool: ONE tensor ``[2 * num_layers, num_host_blocks, block_size, num_kv_heads, head_size]`` (of an
integer type as wide as the KV dtype: the copies move bytes)
(K of layer l at ``2 l``, V at ``2 l + 1``), pinned on CUDA so copies are asynchronous. A host
slot of a block is the same index in every cache tensor.

Copies (per step, per cache tensor): swap-out gathers the step's device blocks with ONE
``index_select`` into a device staging tensor, then copies each run of consecutive host slots
with one ``non_blocking`` copy into the pinned pool; swap-in copies each run from the pool into
the staging tensor and scatters it with ONE ``index_copy_``. The scheduler hands out slots lowest
first, so a step's slots are mostly one run. Everything goes on the current stream, in order:
a swap-out reads its pages after the step in flight wrote them and before this step's forward
overwrites them; a swap-in lands before this step's forward reads it; the host never touches the
pool, so no host sync is needed. The staging tensor holds at most ``SWAP_CHUNK_BLOCKS`` blocks of
one cache tensor (a few MiB), which bounds the device memory a swap needs. On CPU the same code
makes plain copies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

SWAP_CHUNK_BLOCKS = 256  # blocks per gather / scatter: bounds the device staging tensor
# Caches are copied as integers of the same width: bytes move unchanged whatever the KV dtype, and
# index_select / index_copy_ support them everywhere (not float8, e.g. index_copy_ on CPU).
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def kv_block_bytes(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes of one block of the model: K and V of every layer."""
    key = kv_caches[0][0]
    return 2 * len(kv_caches) * math.prod(key.shape[1:]) * key.element_size()


def _runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """``(i, j, first slot)`` for each run ``slots[i:j]`` of consecutive slot ids."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(slots)]))
    return [(int(i), int(j), int(slots[i])) for i, j in zip(starts, ends)]


class KVSwapper:
    def __init__(
        self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], num_host_blocks: int, device: torch.device
    ) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"the host KV pool needs at least one block, got {num_host_blocks}")
        bits = _BITS_DTYPES[kv_caches[0][0].element_size()]
        self.caches = [cache.view(bits) for pair in kv_caches for cache in pair]  # 2L x [num_blocks, bs, heads, head]
        key = self.caches[0]
        self.block_shape = tuple(key.shape[1:])  # [block_size, num_kv_heads, head_size]
        self.dtype = key.dtype
        self.device = device
        self.num_host_blocks = num_host_blocks
        self.block_bytes = kv_block_bytes(kv_caches)
        self.pinned = device.type == "cuda"
        self.host = torch.empty(
            (len(self.caches), num_host_blocks, *self.block_shape), dtype=self.dtype, pin_memory=self.pinned
        )  # [2L, num_host_blocks, block_size, num_kv_heads, head_size]

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.int64)  # [n]
        return index if not self.pinned else index.pin_memory().to(self.device, non_blocking=True)

    def _chunks(self, pairs: Sequence[tuple[int, int]], host_first: bool):
        """Pairs sorted by host slot, in chunks: (device block ids [n], runs of host slots)."""
        ordered = sorted(pairs, key=(lambda p: p[0]) if host_first else (lambda p: p[1]))
        for start in range(0, len(ordered), SWAP_CHUNK_BLOCKS):
            chunk = ordered[start : start + SWAP_CHUNK_BLOCKS]
            host = np.fromiter((p[0] if host_first else p[1] for p in chunk), np.int64, len(chunk))
            device = [p[1] if host_first else p[0] for p in chunk]
            yield device, _runs(host)

    @torch.inference_mode()
    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device block -> host slot for each ``(device block, host slot)`` pair."""
        for device_blocks, runs in self._chunks(pairs, host_first=False):
            index = self._index(device_blocks)  # [n]
            staging = torch.empty((len(device_blocks), *self.block_shape), dtype=self.dtype, device=self.device)
            for host, cache in zip(self.host, self.caches):
                torch.index_select(cache, 0, index, out=staging)  # one gather per cache tensor
                for i, j, slot in runs:
                    host[slot : slot + j - i].copy_(staging[i:j], non_blocking=self.pinned)

    @torch.inference_mode()
    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host slot -> device block for each ``(host slot, device block)`` pair."""
        for device_blocks, runs in self._chunks(pairs, host_first=True):
            index = self._index(device_blocks)  # [n]
            staging = torch.empty((len(device_blocks), *self.block_shape), dtype=self.dtype, device=self.device)
            for host, cache in zip(self.host, self.caches):
                for i, j, slot in runs:
                    staging[i:j].copy_(host[slot : slot + j - i], non_blocking=self.pinned)
                cache.index_copy_(0, index, staging)  # one scatter per cache tensor

    def measure_bandwidth(self, num_blocks: int = 64) -> float:
        """Bytes per second of a swap-out plus swap-in of ``num_blocks`` blocks (each way counted),
        measured on device blocks 0.. and host slots 0..: call it only while no request holds
        them (the round trip puts the same bytes back, so it is harmless even then)."""
        n = max(1, min(num_blocks, self.num_host_blocks, self.caches[0].shape[0]))
        pairs = [(i, i) for i in range(n)]
        self.swap_out(pairs)  # warm (pinned index buffers, kernels)
        self.swap_in(pairs)
        if self.pinned:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.swap_out(pairs)
        self.swap_in(pairs)
        if self.pinned:
            torch.cuda.synchronize(self.device)
        return 2 * n * self.block_bytes / max(time.perf_counter() - start, 1e-9)
