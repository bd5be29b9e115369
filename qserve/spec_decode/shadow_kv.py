"""A draft model's or an EAGLE head's KV cache of its own, indexed by the target's block ids (the
"shadow cache"). Below, "the head" is either.

Knows: the head's per-layer K / V tensors ``[num_target_blocks + num_scratch_blocks, block_size,
head_kv_heads, head_dim]``, how a sequence's positions map to them (the target's block table: the
head's KV of position p sits at the target's slot of p), the scratch blocks that hold the drafted
positions past the target's table during one proposal, and the bytes all of it takes. Must not know:
the scheduler's queues, the head's layers, sampling.

Why the target's blocks: the head attends over exactly the target's tokens, so it needs no pages of
its own. Block b of the shadow cache belongs to whoever holds target block b; the head never
allocates, frees or owns a block, and a speculating sequence holds no page more than the target's.
Its bytes per block are the head's share (1 layer under a 32-layer target: 1/32 of a target block's),
counted in the memory plan as a larger block (``shadow_kv_bytes_per_token``).

Drafted positions: a proposal runs before the scheduler gives the target the slots of the drafts it
will verify (``Scheduler.schedule`` allocates ``1 + len(drafts)`` slots after ``propose`` returns), so
the positions the head drafts from (the last known token onwards) may lie past the target's table.
Those positions' blocks come from the scratch blocks (indices ``num_target_blocks`` and up, never a
target block id), lent for one proposal; positions still inside the target's table (its last, partly
filled block) are written in place: the target has computed none of them, so that block is the
sequence's alone (only full, computed blocks are shared through the prefix cache) and the next catch-up
rewrites them. ``num_scratch_blocks`` scratch blocks cover every proposal.
"""

from __future__ import annotations

import numpy as np
import torch

from qserve.config import ModelConfig
from qserve.runner.model_runner import allocate_kv_caches
from qserve.scheduler.kv_cache_manager import KVCacheManager, cdiv


def shadow_kv_bytes_per_token(head: ModelConfig, kv_dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in the head's layers (what every target block grows by,
    per token, in the memory plan)."""
    return 2 * head.num_layers * head.num_kv_heads * head.head_dim * torch.empty((), dtype=kv_dtype).element_size()


def num_scratch_blocks(max_num_seqs: int, num_speculative_tokens: int, block_size: int, draft: bool = False) -> int:
    """Scratch blocks for one proposal. The target's table covers every position before the last
    known token; past it an EAGLE head writes the KV of at most k - 1 positions (it drafts from the
    last known token on), a draft model of k (the last known token itself, then k - 1 drafts): at
    most ``cdiv(k - 1, block_size)`` (``cdiv(k, block_size)``) blocks per proposing sequence."""
    positions = num_speculative_tokens if draft else num_speculative_tokens - 1
    return max_num_seqs * cdiv(max(positions, 0), block_size)


class ShadowKV:
    """The head's KV caches and the block tables that address them."""

    def __init__(
        self,
        head: ModelConfig,
        target: KVCacheManager,
        num_target_blocks: int,
        num_scratch: int,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.target = target
        self.block_size = target.block_size
        self.num_target_blocks = num_target_blocks
        # per head layer (K, V) [num_target_blocks + num_scratch, block_size, head_kv_heads, head_dim]
        self.kv_caches = allocate_kv_caches(head, num_target_blocks + num_scratch, self.block_size, kv_dtype, device)
        self._scratch = list(range(num_target_blocks, num_target_blocks + num_scratch))
        self._lent: list[int] = []

    def covers(self, request_id: str, end: int) -> bool:
        """The target's table holds positions ``[0, end)`` of the sequence (a catch-up's positions
        were all computed by the target, so they always do)."""
        return end <= len(self.target.block_table(request_id)) * self.block_size

    def table(self, request_id: str) -> list[int]:
        """The sequence's blocks for positions the target holds (a copy of the target's table)."""
        return list(self.target.block_table(request_id))

    def shared(self, blocks: np.ndarray) -> np.ndarray:
        """bool, ``blocks``' shape: which of these block ids another sequence holds too (a target block
        with more than one reference, shared through the prefix cache; never a scratch block). The
        head must store no KV there: the other holder's head reads it."""
        pool = self.target.pool
        unique, inverse = np.unique(blocks, return_inverse=True)  # one look-up per block, not per slot
        flags = np.array([b < self.num_target_blocks and pool.ref_count(int(b)) > 1 for b in unique], dtype=bool)
        return flags[inverse].reshape(blocks.shape)

    def draft_table(self, request_id: str, end: int) -> list[int] | None:
        """The blocks for positions ``[0, end)``: the target's, then scratch blocks for what lies
        past them (lent until ``return_scratch``); None when the scratch blocks are spent."""
        table = self.table(request_id)
        need = cdiv(end, self.block_size) - len(table)
        if need > len(self._scratch):
            return None
        if need > 0:
            lent, self._scratch = self._scratch[:need], self._scratch[need:]
            self._lent += lent
            table += lent
        return table

    def return_scratch(self) -> None:
        """The proposal is over: its drafted positions' KV is never read again (every block lent)."""
        self._scratch += self._lent
        self._lent = []

    def release(self, blocks: list[int]) -> None:
        """Give back these lent blocks (a draft model keeps a sequence's until its next proposal)."""
        gone = set(blocks)
        self._lent = [b for b in self._lent if b not in gone]
        self._scratch += blocks

    def move_rows(self, src: int, dst: int, num_rows: int) -> None:
        """Copy the first ``num_rows`` slots of block ``src`` to block ``dst`` in every layer (a
        scratch block's valid KV into the target block that now holds those positions)."""
        if num_rows > 0:
            for key, value in self.kv_caches:
                key[dst, :num_rows] = key[src, :num_rows]  # [num_rows, kv_heads, head_dim]
                value[dst, :num_rows] = value[src, :num_rows]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv_caches for t in pair)
