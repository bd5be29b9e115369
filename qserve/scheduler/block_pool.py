"""The one pool of fixed-size KV pages (blocks) that every model of the process shares.

Knows: block ids ``0 .. num_blocks-1``, their reference counts, which owner (model) holds
each one, the LRU free queue, and the prefix-cache index ``hash -> block id``. Enforces the
optional per-owner minimum / maximum shares. Must not know: torch, tensors, requests, token
ids or block sizes (a block is just an id here). Pure Python, every operation O(1) per block
(O(number of owners) for the share check).

Free queue: an ``OrderedDict`` keyed by block id, least recently freed first. A block whose
refcount drops to 0 goes to its tail. If it carries a prefix-cache hash it stays findable by
``lookup`` until ``allocate`` pops it from the head and drops the hash (eviction); ``touch``
can take it back out of the middle of the queue in O(1).

Shares: ``min_blocks`` of an owner are reserved for it — free blocks that another owner's
unmet minimum still needs are not handed out to anyone else. ``max_blocks`` caps how many
blocks an owner may hold at once. Cached blocks with refcount 0 count as free (evictable).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from qserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, KVEventRecorder

DEFAULT_OWNER = "default"


@dataclass(frozen=True, slots=True)
class OwnerShare:
    """Share of the pool one owner (model) is guaranteed / allowed to hold, in blocks."""

    min_blocks: int = 0
    max_blocks: int | None = None  # None: no cap beyond the pool itself


class BlockPool:
    """Refcounted KV blocks with an LRU free queue and a hash index for prefix caching."""

    def __init__(self, num_blocks: int, shares: Mapping[str, OwnerShare] | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"BlockPool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt: list[int] = [0] * num_blocks
        self._owner: list[str | None] = [None] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        # Least recently freed first; values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_used: dict[str, int] = {}
        self._shares: dict[str, OwnerShare] = {}
        for owner, share in (shares or {}).items():
            self.set_share(owner, min_blocks=share.min_blocks, max_blocks=share.max_blocks)
        # KV-cache events (prefix-aware routing): recorded only when a recorder is attached.
        self.kv_events: KVEventRecorder | None = None

    # ---------------------------------------------------------------- shares / accounting
    def set_share(self, owner: str, min_blocks: int = 0, max_blocks: int | None = None) -> None:
        if min_blocks < 0 or (max_blocks is not None and max_blocks < min_blocks):
            raise ValueError(f"owner {owner!r}: need 0 <= min_blocks <= max_blocks, got {min_blocks}, {max_blocks}")
        total_min = min_blocks + sum(s.min_blocks for o, s in self._shares.items() if o != owner)
        if total_min > self.num_blocks:
            raise ValueError(
                f"owner {owner!r}: minimum shares add up to {total_min} blocks, the pool has {self.num_blocks}"
            )
        self._shares[owner] = OwnerShare(min_blocks=min_blocks, max_blocks=max_blocks)

    def share(self, owner: str) -> OwnerShare:
        return self._shares.get(owner, OwnerShare())

    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0 (including cached, evictable ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_used_by(self, owner: str) -> int:
        return self._num_used.get(owner, 0)

    def _reserved_for_others(self, owner: str) -> int:
        return sum(max(0, s.min_blocks - self._num_used.get(o, 0)) for o, s in self._shares.items() if o != owner)

    def num_available(self, owner: str = DEFAULT_OWNER) -> int:
        """How many blocks ``owner`` could take right now (free, not reserved for others, under its max)."""
        available = len(self._free) - self._reserved_for_others(owner)
        max_blocks = self.share(owner).max_blocks
        if max_blocks is not None:
            available = min(available, max_blocks - self.num_used_by(owner))
        return max(0, available)

    def can_allocate(self, num_blocks: int, owner: str = DEFAULT_OWNER) -> bool:
        return num_blocks <= self.num_available(owner)

    def capacity(self, owner: str = DEFAULT_OWNER) -> int:
        """The most blocks ``owner`` could EVER hold (whole pool minus others' minimums, capped by its max)."""
        cap = self.num_blocks - sum(s.min_blocks for o, s in self._shares.items() if o != owner)
        max_blocks = self.share(owner).max_blocks
        return cap if max_blocks is None else min(cap, max_blocks)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def owner_of(self, block_id: int) -> str | None:
        return self._owner[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be evicted) first. For tests and debugging."""
        return list(self._free)

    # ---------------------------------------------------------------- allocate / free
    def allocate(self, num_blocks: int, owner: str = DEFAULT_OWNER) -> list[int] | None:
        """Take ``num_blocks`` blocks from the head of the free queue (all or nothing).

        Returns None when the pool (or the owner's share) cannot supply them. A cached block
        taken this way is evicted: its hash is dropped from the index.
        """
        if num_blocks < 0:
            raise ValueError(f"allocate: num_blocks must be >= 0, got {num_blocks}")
        if not self.can_allocate(num_blocks, owner):
            return None
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict_hash(block_id)
            self._ref_cnt[block_id] = 1
            self._owner[block_id] = owner
            block_ids.append(block_id)
        self._num_used[owner] = self._num_used.get(owner, 0) + num_blocks
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; a free (cached) block leaves the free queue."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
                owner = self._owner[block_id]
                assert owner is not None
                self._num_used[owner] = self._num_used.get(owner, 0) + 1
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order; at 0 it joins the free queue tail.

        Callers free a request's blocks in REVERSE order so its tail blocks are evicted first.
        """
        for block_id in block_ids:
            ref = self._ref_cnt[block_id]
            if ref <= 0:
                raise ValueError(f"free: block {block_id} is not allocated (double free)")
            self._ref_cnt[block_id] = ref - 1
            if ref == 1:
                self._free[block_id] = None
                owner = self._owner[block_id]
                assert owner is not None
                self._num_used[owner] -= 1

    # ---------------------------------------------------------------- prefix-cache index
    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full block under ``block_hash``. False (nothing changed) if that hash is
        already held by another block or this block already carries a hash."""
        current = self._block_hash[block_id]
        if current is not None:
            return current == block_hash
        if block_hash in self._hash_to_block:
            return False
        self._block_hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def lookup(self, block_hash: int) -> int | None:
        return self._hash_to_block.get(block_hash)

    def block_hash(self, block_id: int) -> int | None:
        return self._block_hash[block_id]

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents, they just stop being findable)."""
        for block_id in self._hash_to_block.values():
            self._block_hash[block_id] = None
        self._hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.record(AllBlocksCleared(None))

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            self._block_hash[block_id] = None
            del self._hash_to_block[block_hash]
            if self.kv_events is not None:
                self.kv_events.record(BlockRemoved(self._owner[block_id] or DEFAULT_OWNER, [block_hash]))
