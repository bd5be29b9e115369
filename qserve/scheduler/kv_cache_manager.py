"""One model's view of the shared block pool: per-request block tables and prefix-cache use.

Knows: the block size, each request's block table (``request_id -> [block ids]``, logical
block i of the sequence lives in physical block ``table[i]``), how many of a request's
blocks are registered in the prefix cache, the owner name under which this model draws from
the pool. Must not know: torch, tensors, queues or scheduling policy (that is the
scheduler's), other models' requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from qserve.request import Request
from qserve.scheduler.block_pool import DEFAULT_OWNER, BlockPool
from qserve.scheduler.kv_events import BlockStored, KVEventRecorder, block_token_ids
from qserve.scheduler.prefix_cache import (
    find_longest_cache_hit,
    max_cache_hit_blocks,
    owner_seed,
    update_block_hashes,
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool = True,
        owner: str = DEFAULT_OWNER,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.owner = owner
        self.hash_seed = owner_seed(owner)
        self._lora_seeds: dict[int, int] = {}  # LoRA adapter id -> its chain's seed (see _seed)
        self._tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of the table already in the index
        # Prefix-cache statistics (tokens), for metrics.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ---------------------------------------------------------------- queries
    def block_table(self, request_id: str) -> list[int]:
        """The request's live block table (shared reference; empty if it holds no blocks)."""
        return self._tables.get(request_id, [])

    @property
    def max_num_blocks(self) -> int:
        """The most blocks this model could ever hold in the pool."""
        return self.pool.capacity(self.owner)

    @property
    def max_num_tokens(self) -> int:
        """The longest sequence whose KV this model could ever hold."""
        return self.max_num_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---------------------------------------------------------------- prefix cache
    def _seed(self, request: Request) -> int:
        """The hash chain's start: the owner's, or, for a request on a LoRA adapter, one of that
        adapter's own (its KV differs from the base model's for the same tokens, so two adapters, or an
        adapter and the base, never share a cached block; a re-loaded adapter gets a new id)."""
        if request.lora_id is None:
            return self.hash_seed
        seed = self._lora_seeds.get(request.lora_id)
        if seed is None:
            seed = self._lora_seeds[request.lora_id] = owner_seed(f"{self.owner}\x00lora:{request.lora_id}")
        return seed

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block ids, number of tokens they hold).

        Does not take references (``allocate_slots`` does). Capped so at least one token is
        always computed. Requests asking for ``prompt_logprobs`` never hit: every prompt
        position's logits must be computed.
        """
        if not self.enable_prefix_caching:
            return [], 0
        if getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return [], 0
        hashes = update_block_hashes(request, self.block_size, self._seed(request))
        hit = find_longest_cache_hit(self.pool, hashes, max_cache_hit_blocks(request.num_tokens, self.block_size))
        num_hit_tokens = len(hit) * self.block_size
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += num_hit_tokens
        return hit, num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full AND computed (prompt or generated tokens)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        hashes = update_block_hashes(request, self.block_size, self._seed(request))
        events = self.pool.kv_events
        if events is not None:
            self._cache_blocks_with_events(request, table, hashes, num_cached, num_full, events)
        else:
            for i in range(num_cached, num_full):
                # False when another block already holds this hash (computed concurrently): keep that one.
                self.pool.cache_block(table[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def _cache_blocks_with_events(
        self,
        request: Request,
        table: list[int],
        hashes: list[int],
        first: int,
        end: int,
        events: KVEventRecorder,
    ) -> None:
        """``cache_full_blocks`` recording a ``BlockStored`` per run of newly registered blocks."""
        run_start: int | None = None

        def flush(stop: int) -> None:
            if run_start is None:
                return
            parent = hashes[run_start - 1] if run_start > 0 else None
            tokens = block_token_ids(request, run_start, stop - run_start, self.block_size)
            events.record(
                BlockStored(self.owner, hashes[run_start:stop], parent, tokens, self.block_size, request.lora_id)
            )

        for i in range(first, end):
            stored = self.pool.block_hash(table[i]) is None and self.pool.cache_block(table[i], hashes[i])
            if stored and run_start is None:
                run_start = i
            elif not stored and run_start is not None:
                flush(i)
                run_start = None
        flush(end)

    # ---------------------------------------------------------------- allocate / free
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        reserve: int = 0,
    ) -> bool:
        """Grow the block table to cover ``num_computed + num_new_tokens`` tokens, where
        ``num_computed = request.num_computed_tokens + len(computed_blocks) * block_size``.

        ``computed_blocks`` (prefix-cache hits from ``get_computed_blocks``) are only allowed
        for a request holding no blocks yet; they get a reference and head the table. All or
        nothing: returns False, changing nothing, when the pool cannot supply the pages (or, with
        ``reserve``, cannot supply them and still keep ``reserve`` more available).
        """
        request_id = request.request_id
        table = self._tables.get(request_id)
        if table and not computed_blocks:
            # Fast path (most decode steps): the blocks held already cover the new tokens.
            if -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) <= len(table):
                return True
        if computed_blocks and table:
            raise ValueError(f"request {request_id}: computed blocks given but it already holds blocks")
        num_held = len(table) if table else 0
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - num_held - len(computed_blocks))
        # Cached hits sitting in the free queue are taken out of it: they cost free blocks too.
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        if not self.pool.can_allocate(num_new_blocks + num_revived + reserve, self.owner):
            return False
        if table is None:
            table = self._tables[request_id] = []
        if computed_blocks:
            self.pool.touch(computed_blocks)  # before allocate, so allocation cannot evict them
            table.extend(computed_blocks)
            self._num_cached_blocks[request_id] = len(computed_blocks)
        if num_new_blocks:
            new_blocks = self.pool.allocate(num_new_blocks, self.owner)
            assert new_blocks is not None  # checked above
            table.extend(new_blocks)
        return True

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Return the blocks past the first ``cdiv(num_tokens, block_size)`` of the request's table
        (speculative decoding: pages that only rejected draft tokens reached), tail first. Blocks
        registered in the prefix cache are never among them (they hold computed tokens)."""
        table = self._tables.get(request.request_id)
        if not table:
            return
        keep = max(cdiv(num_tokens, self.block_size), self._num_cached_blocks.get(request.request_id, 0))
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.pool.free(reversed(tail))

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so its tail is evicted before its head."""
        table = self._tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))
