"""CUDA graphs of an EAGLE head's drafting forwards: one graph per batch-size bucket of ONE forward of
one row per sequence (the head reading the previous draft and its own output feature) plus the draft
token's argmax, replayed k - 1 times per proposal.

Knows: the head's call (``EagleHead.forward`` / ``draft_tokens``), the static buffers one forward
reads and writes, and how a proposal's k - 1 steps are staged: every step's positions, slots and
lengths in one host-to-device copy, then per step device-side copies into the graph's inputs (the
previous step's outputs feed the next). Must not know: requests, the shadow cache's bookkeeping,
scheduling (``qserve.spec_decode.eagle.EagleProposer`` computes the positions and slots and decides
when a batch fits).

Why one forward per graph, not the whole chain: the number of drafts changes per step (adaptive k,
``max_num_tokens`` near a request's end), and a sequence that needs fewer drafts than the longest
one keeps its row with slot -1 (its KV is never stored) and its last valid position (its attention
reads only its own blocks); its outputs are dropped by the proposer. Eagerly each forward launches
every kernel of the head from Python: on an H100 a four-layer head's forward took about 3 ms against
the 0.7 ms its weights take to read (bench/RESULTS.md, tenth session).

Pad rows past the batch up to the bucket: slot -1, position 0, length 1, block 0. Block-table
columns past a batch's width keep stale ids from earlier proposals: kernels never read past a
sequence's length, and stale ids are valid ids of the shadow cache.

Attention: ``max_query_len`` 1 (the decode kernel) and ``max_seq_len`` fixed to the graphs' largest
length (kernels size their grids from it), as in ``qserve.runner.cuda_graphs``.

Sharing (``share``): the target's decode graphs lend their memory pool; every graph of the process
replays on one stream, and the outputs are copied into this object's own static buffers.

Off CUDA, ``capture`` records nothing: each bucket reruns the same static-buffer forward eagerly at
replay (``StaticReplay``), so the CPU tests run everything but the capture itself.
"""

from __future__ import annotations

import logging
from bisect import bisect_left

import numpy as np
import torch

from qserve.runner.attn_metadata import AttentionMetadata
from qserve.runner.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs, StaticReplay, garbage_collected_first
from qserve.spec_decode.eagle_head import EagleHead

logger = logging.getLogger(__name__)

# Staged per step: positions, slots, sequence lengths (one int64 row each).
_STAGED_ROWS = 3


class HeadDraftGraphs:
    """Captured drafting forwards of ``head`` for batch sizes ``buckets`` (padded to the next one)."""

    def __init__(
        self,
        head: EagleHead,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # the head's (shadow) caches, one per layer
        max_num_seqs: int,
        max_steps: int,  # drafting forwards per proposal at most: num_speculative_tokens - 1
        max_seq_len: int,  # the longest sequence a drafting forward attends over
        max_blocks: int,  # block-table width: blocks of the longest draft table
        device: torch.device,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        share: DecodeGraphs | None = None,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.head = head
        self.kv_caches = kv_caches
        self.max_steps = max_steps
        self.max_seq_len = max_seq_len
        self.buckets = tuple(sorted({b for b in buckets if b < max_num_seqs} | {max_num_seqs}))
        max_batch = self.buckets[-1]
        hidden = head.config.model.hidden_size
        dtype = head.layers[0].post_attention_layernorm.weight.dtype
        int64 = {"dtype": torch.int64, "device": device}
        # One forward's inputs (a graph of batch B reads the first B rows).
        self.tokens = torch.zeros(max_batch, **int64)  # [max_batch]: the previous draft
        self.features = torch.zeros(max_batch, hidden, dtype=dtype, device=device)  # [max_batch, H]
        self.positions = torch.zeros(max_batch, **int64)  # [max_batch]
        self.slot_mapping = torch.full((max_batch,), -1, **int64)  # [max_batch]; -1 = not stored
        self.seq_lens = torch.ones(max_batch, **int64)  # [max_batch]
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, **int64)  # [max_batch + 1]: one row each
        # Its outputs: the draft and the next feature of every row.
        self.out_tokens = torch.zeros(max_batch, **int64)  # [max_batch]
        self.out_features = torch.zeros(max_batch, hidden, dtype=dtype, device=device)  # [max_batch, H]
        # A proposal's staged steps: [positions, slots, seq_lens] x step x row, one copy per proposal.
        self.staged = torch.zeros(_STAGED_ROWS, max_steps, max_batch, **int64)
        self.graphs: dict[int, torch.cuda.CUDAGraph | StaticReplay] = {}
        self.pool = None if share is None else share.pool

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def _run(self, batch: int) -> None:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            max_query_len=1,
            max_seq_len=self.max_seq_len,  # fixed: kernels size their grids from it
        )
        logits_in, feature = self.head(
            self.tokens[:batch], self.positions[:batch], self.features[:batch], self.kv_caches, metadata
        )  # [B, H], [B, H]
        self.out_tokens[:batch].copy_(self.head.draft_tokens(logits_in))
        self.out_features[:batch].copy_(feature)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture, largest bucket first (off CUDA: ``StaticReplay`` stand-ins)."""
        if self.tokens.device.type != "cuda":
            for batch in self.buckets:
                self.graphs[batch] = StaticReplay(lambda b=batch: self._run(b))
            logger.info("EAGLE head drafting graphs replayed eagerly off CUDA (batch sizes %s)", list(self.buckets))
            return
        torch.cuda.synchronize()
        with garbage_collected_first():
            for batch in reversed(self.buckets):
                self._run(batch)  # warm-up outside capture (pad rows: slot -1, nothing stored)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._run(batch)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d EAGLE head drafting CUDA graphs (batch sizes %s)", len(self.graphs), list(self.buckets)
        )

    def bucket_for(self, batch: int) -> int | None:
        if batch > self.buckets[-1]:
            return None
        return self.buckets[bisect_left(self.buckets, batch)]

    def fits(self, batch: int, steps: int, width: int) -> bool:
        """Whether a proposal of ``batch`` rows, ``steps`` drafting forwards and block tables ``width``
        wide can replay these graphs."""
        return self.bucket_for(batch) is not None and 1 <= steps <= self.max_steps and width <= self.max_blocks

    @torch.inference_mode()
    def draft(
        self,
        first_tokens: torch.Tensor,  # int64 [R] on the device: every row's first draft
        first_features: torch.Tensor,  # [R, H] on the device: the feature the first draft came with
        positions: np.ndarray,  # int64 [steps, R]
        slots: np.ndarray,  # int64 [steps, R] (-1: not stored)
        block_tables: np.ndarray,  # int32 [R, width]
    ) -> torch.Tensor:
        """int64 ``[steps, R]`` on the device: the drafts of forwards 1..steps (row order of the inputs),
        each forward reading the previous one's draft and output feature."""
        steps, batch = positions.shape
        bucket = self.bucket_for(batch)
        assert bucket is not None and self.fits(batch, steps, block_tables.shape[1])
        host = np.zeros((_STAGED_ROWS, steps, bucket), dtype=np.int64)
        host[0, :, :batch] = positions
        host[1, :, :] = -1
        host[1, :, :batch] = slots
        host[2, :, :] = 1
        host[2, :, :batch] = positions + 1
        staged = torch.from_numpy(host)
        pinned = self.tokens.is_cuda
        if pinned:  # asynchronous copies: the target's step may still be running (async scheduling)
            staged = staged.pin_memory()
        self.staged[:, :steps, :bucket].copy_(staged, non_blocking=True)
        width = block_tables.shape[1]
        tables = torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32))
        self.block_tables[:batch, :width].copy_(tables.pin_memory() if pinned else tables, non_blocking=True)
        self.block_tables[batch:bucket, 0] = 0
        self.tokens[:batch].copy_(first_tokens)
        self.features[:batch].copy_(first_features)
        drafts = torch.empty(steps, batch, dtype=torch.int64, device=self.tokens.device)  # [steps, R]
        graph = self.graphs[bucket]
        for step in range(steps):
            if step:  # the previous forward's outputs are this one's inputs
                self.tokens[:bucket].copy_(self.out_tokens[:bucket])
                self.features[:bucket].copy_(self.out_features[:bucket])
            self.positions[:bucket].copy_(self.staged[0, step, :bucket])
            self.slot_mapping[:bucket].copy_(self.staged[1, step, :bucket])
            self.seq_lens[:bucket].copy_(self.staged[2, step, :bucket])
            graph.replay()
            drafts[step].copy_(self.out_tokens[:batch])
        return drafts
