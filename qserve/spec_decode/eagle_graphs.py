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

Catch-up forwards (``HeadCatchUpGraphs``, default on; ``QSERVE_EAGLE_CATCH_UP_GRAPHS=0`` opts out): after a step of
the target the head runs once over the positions each sequence just kept (1 after a plain decode, up
to k + 1 after a verify). Those forwards fit a layout of Q = k + 1 rows per sequence, as the target's
verify graphs (``qserve.runner.cuda_graphs``: a sequence's n real rows are the last n of its Q, the pad
rows before them sit at the positions just before its first real one, slot -1, so the sequence needs
at least Q positions), attention through the prefill/extend kernel, and each sequence's last row (the
one the next proposal drafts from) gathered in the graph. Sequences with more rows (a prompt chunk) or
fewer than Q positions catch up eagerly.

Off CUDA, ``capture`` records nothing: each bucket reruns the same static-buffer forward eagerly at
replay (``StaticReplay``), so the CPU tests run everything but the capture itself.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from qserve.runner.attn_metadata import AttentionMetadata
from qserve.runner.cuda_graphs import (
    DEFAULT_BUCKETS,
    DecodeGraphs,
    StaticReplay,
    bucket_sizes,
    capture_buckets,
    smallest_bucket,
    static_positions,
    static_rows,
)
from qserve.spec_decode.eagle_head import EagleHead

logger = logging.getLogger(__name__)

# Staged per step: positions, slots, sequence lengths (one int64 row each).
_STAGED_ROWS = 3


class _HeadGraphs:
    """What both kinds share: the head's static inputs for ``query_len`` rows per sequence, one graph
    per batch bucket, captured into ``share``'s pool; ``_run(batch)`` (the subclass's) is one graph's
    body. Each subclass writes its outputs into its own static buffers."""

    kind = ""

    def __init__(
        self,
        head: EagleHead,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # the head's (shadow) caches, one per layer
        max_num_seqs: int,
        query_len: int,  # rows per sequence
        max_seq_len: int,  # the longest sequence a forward attends over
        max_blocks: int,  # block-table width
        device: torch.device,
        buckets: tuple[int, ...],
        share: DecodeGraphs | None,
    ) -> None:
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len}")
        self.head = head
        self.kv_caches = kv_caches
        self.query_len = query_len
        self.max_seq_len = max_seq_len
        self.buckets = bucket_sizes(buckets, max_num_seqs)
        max_batch = self.buckets[-1]
        max_rows = max_batch * query_len
        hidden = head.config.model.hidden_size
        dtype = head.layers[0].post_attention_layernorm.weight.dtype
        int64 = {"dtype": torch.int64, "device": device}
        # Inputs (a graph of batch B reads the first B * query_len rows).
        self.tokens = torch.zeros(max_rows, **int64)  # [max_rows]: the token after each position
        self.features = torch.zeros(max_rows, hidden, dtype=dtype, device=device)  # [max_rows, H]
        self.positions = torch.zeros(max_rows, **int64)  # [max_rows]
        self.slot_mapping = torch.full((max_rows,), -1, **int64)  # [max_rows]; -1 = not stored
        self.seq_lens = torch.full((max_batch,), query_len, **int64)  # [max_batch]
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, **int64) * query_len  # [max_batch + 1]
        # Every subclass's outputs include each sequence's next feature.
        self.out_features = torch.zeros(max_batch, hidden, dtype=dtype, device=device)  # [max_batch, H]
        self.graphs: dict[int, torch.cuda.CUDAGraph | StaticReplay] = {}
        self.pool = None if share is None else share.pool

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def _forward(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the first ``batch`` sequences' rows: (logits inputs, next features), ``[rows, H]``."""
        rows = batch * self.query_len
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            max_query_len=self.query_len,
            max_seq_len=self.max_seq_len,  # fixed: kernels size their grids from it
        )
        return self.head(self.tokens[:rows], self.positions[:rows], self.features[:rows], self.kv_caches, metadata)

    def _run(self, batch: int) -> None:
        raise NotImplementedError

    def _stage_tables(self, block_tables: np.ndarray, bucket: int) -> None:
        """``block_tables`` (int32 ``[B, width]``) into the first B rows, asynchronously from pinned
        memory on CUDA; the pad sequences' rows up to ``bucket`` read block 0."""
        batch, width = block_tables.shape
        tables = torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32))
        pinned = self.tokens.is_cuda
        self.block_tables[:batch, :width].copy_(tables.pin_memory() if pinned else tables, non_blocking=True)
        self.block_tables[batch:bucket] = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture, largest bucket first (off CUDA: ``StaticReplay`` stand-ins). The
        warm-ups store nothing: every row's slot is -1 until a real replay stages its own."""
        if self.tokens.device.type != "cuda":
            for batch in self.buckets:
                self.graphs[batch] = StaticReplay(lambda b=batch: self._run(b))
            logger.info(
                "EAGLE head %s graphs replayed eagerly off CUDA (batch sizes %s)", self.kind, list(self.buckets)
            )
            return
        graphs, self.pool = capture_buckets(self.buckets, self._run, self.pool)
        self.graphs.update(graphs)
        logger.info(
            "captured %d EAGLE head %s CUDA graphs of %d row(s) per sequence (batch sizes %s)",
            len(self.graphs),
            self.kind,
            self.query_len,
            list(self.buckets),
        )

    def bucket_for(self, batch: int) -> int | None:
        return smallest_bucket(self.buckets, batch)


class HeadDraftGraphs(_HeadGraphs):
    """Captured drafting forwards of ``head`` (one row per sequence) plus each row's draft."""

    kind = "drafting"

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
        super().__init__(head, kv_caches, max_num_seqs, 1, max_seq_len, max_blocks, device, buckets, share)
        self.max_steps = max_steps
        max_batch = self.buckets[-1]
        self.out_tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # [max_batch]: each draft
        # A proposal's staged steps: [positions, slots, seq_lens] x step x row, one copy per proposal; until
        # a proposal stages its own, position 0, slot -1 (a warm-up stores nothing), length 1.
        self.staged = torch.zeros(_STAGED_ROWS, max_steps, max_batch, dtype=torch.int64, device=device)
        self.staged[1] = -1
        self.staged[2] = 1

    def _run(self, batch: int) -> None:
        logits_in, feature = self._forward(batch)  # [B, H], [B, H]
        self.out_tokens[:batch].copy_(self.head.draft_tokens(logits_in))
        self.out_features[:batch].copy_(feature)

    def _stage_step(self, step: int, batch: int) -> None:
        """Forward ``step``'s inputs from the staged rows (and, past the first, the previous outputs)."""
        if step:  # the previous forward's outputs are this one's inputs
            self.tokens[:batch].copy_(self.out_tokens[:batch])
            self.features[:batch].copy_(self.out_features[:batch])
        self.positions[:batch].copy_(self.staged[0, step, :batch])
        self.slot_mapping[:batch].copy_(self.staged[1, step, :batch])
        self.seq_lens[:batch].copy_(self.staged[2, step, :batch])

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
        self._stage_tables(block_tables, bucket)
        self.tokens[:batch].copy_(first_tokens)
        self.features[:batch].copy_(first_features)
        drafts = torch.empty(steps, batch, dtype=torch.int64, device=self.tokens.device)  # [steps, R]
        graph = self.graphs[bucket]
        for step in range(steps):
            self._stage_step(step, bucket)
            graph.replay()
            drafts[step].copy_(self.out_tokens[:batch])
        return drafts


class HeadCatchUpGraphs(_HeadGraphs):
    """Captured catch-up forwards of ``head``: ``query_len`` rows per sequence (module doc); each
    sequence's last row's outputs gathered."""

    kind = "catch-up"

    def __init__(
        self,
        head: EagleHead,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # the head's (shadow) caches, one per layer
        max_num_seqs: int,
        query_len: int,  # rows per sequence: k + 1
        max_seq_len: int,
        max_blocks: int,
        device: torch.device,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        share: DecodeGraphs | None = None,
    ) -> None:
        super().__init__(head, kv_caches, max_num_seqs, query_len, max_seq_len, max_blocks, device, buckets, share)
        max_batch = self.buckets[-1]
        self.last_rows = torch.arange(max_batch, dtype=torch.int64, device=device) * query_len + query_len - 1
        # Each sequence's last row: the logits' input of its first draft (and, above, its next feature).
        self.out_logits_in = torch.zeros_like(self.out_features)  # [max_batch, H]

    def _run(self, batch: int) -> None:
        logits_in, feature = self._forward(batch)  # [rows, H], [rows, H]
        last = self.last_rows[:batch]
        self.out_logits_in[:batch].copy_(logits_in.index_select(0, last))
        self.out_features[:batch].copy_(feature.index_select(0, last))

    def fits(self, count: int, end: int) -> bool:
        """Whether a sequence catching up on ``count`` positions ending at ``end`` fits the layout."""
        return 1 <= count <= self.query_len and end >= self.query_len

    @torch.inference_mode()
    def catch_up(
        self,
        input_ids: list[int],  # [T]: the token after each position, sequence after sequence
        features: torch.Tensor,  # [T, H] on the device
        counts: np.ndarray,  # int64 [S]: positions per sequence (each fits)
        seq_lens: np.ndarray,  # int64 [S]: each sequence's end (its last position + 1)
        slots: np.ndarray,  # int64 [T] (-1: not stored)
        block_tables: np.ndarray,  # int32 [S, width]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits input ``[S, H]``, next feature ``[S, H]``) of each sequence's last position, new
        tensors (the next replay rewrites the graphs' outputs)."""
        batch = len(counts)
        bucket = self.bucket_for(batch)
        assert bucket is not None and block_tables.shape[1] <= self.max_blocks
        query_len = self.query_len
        rows = static_rows(counts, query_len)  # [T]
        lengths = np.full(bucket, query_len, dtype=np.int64)  # pad sequences: length Q over block 0
        lengths[:batch] = seq_lens
        host = np.zeros((4, bucket * query_len), dtype=np.int64)  # ids, positions, slots, rows of the features
        host[0, rows] = input_ids
        host[1] = static_positions(lengths, query_len)
        host[2] = -1
        host[2, rows] = slots
        staged = torch.from_numpy(host)
        pinned = self.tokens.is_cuda
        if pinned:  # asynchronous copies: the target's step may still be running (async scheduling)
            staged = staged.pin_memory()
        size = bucket * query_len
        self.tokens[:size].copy_(staged[0], non_blocking=True)
        self.positions[:size].copy_(staged[1], non_blocking=True)
        self.slot_mapping[:size].copy_(staged[2], non_blocking=True)
        seq_lens_host = torch.from_numpy(lengths)
        self.seq_lens[:bucket].copy_(seq_lens_host.pin_memory() if pinned else seq_lens_host, non_blocking=True)
        real = torch.from_numpy(rows)
        real = real.pin_memory().to(self.features.device, non_blocking=True) if pinned else real
        self.features.index_copy_(0, real, features.to(self.features.dtype))
        self._stage_tables(block_tables, bucket)
        self.graphs[bucket].replay()
        return self.out_logits_in[:batch].clone(), self.out_features[:batch].clone()
