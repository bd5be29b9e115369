"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with static inputs.

Knows: how to capture ``model(...)`` + ``compute_logits`` for pure-decode batches (one new
token per sequence) into graphs sharing one memory pool, and how to feed a step into the
static buffers. Must not know: scheduling, sampling or the kernels' internals — it only
relies on the kernels being capture-safe (no host sync, grids fixed by the arguments) and on
the KV-store kernel skipping negative slots, which pad rows use.

LoRA (``max_loras``, opt-in with ``QSERVE_LORA_GRAPHS=1``): the graphs also take each row's adapter
slot and the rows' tiles as static inputs (``LoRAIndices`` views of fixed size: pad rows and base rows
have slot -1, unused tiles length 0), so steps mixing adapters and the base replay the same graph.
They are views of one int32 buffer, laid out per bucket (``lora_ops.index_layout``), which a replay
refills with one host-to-device copy (the split-K arrival counters included, copied as zeros).
Without ``max_loras`` nothing of this exists and the graphs are exactly the base model's.
"""

from __future__ import annotations

import logging
from bisect import bisect_left

import numpy as np
import torch

from qserve.runner.attn_metadata import AttentionMetadata
from quant_kernels.lora_ops import LoRAIndices, fill_index_buffer, index_layout, indices_from_buffer, max_lora_tiles

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    """Captured decode graphs for batch sizes ``buckets`` (padded up to the next bucket)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        max_loras: int | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = tuple(sorted({b for b in buckets if b < max_num_seqs} | {max_num_seqs}))
        max_batch = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        int64 = {"dtype": torch.int64, "device": device}
        # Static inputs, shared by every graph (a graph of batch B reads the first B rows).
        self.input_ids = torch.zeros(max_batch, **int64)  # [max_batch]
        self.positions = torch.zeros(max_batch, **int64)  # [max_batch]
        self.slot_mapping = torch.full((max_batch,), -1, **int64)  # [max_batch]; -1 = pad row
        self.seq_lens = torch.ones(max_batch, **int64)  # [max_batch]
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, **int64)  # [max_batch + 1]
        # Qwen v1 dynamic NTK: each row's rotary table (its sequence's alpha, fixed at prefill),
        # an input like the positions, so mixed-alpha batches replay the same graph.
        has_ntk = getattr(getattr(model, "rotary", None), "num_ntk_tables", 1) > 1
        self.ntk_tables = torch.zeros(max_batch, **int64) if has_ntk else None  # [max_batch]
        vocab = model.config.vocab_size
        # One output buffer for every graph: per-bucket outputs would each stay alive in the
        # pool (on a 152k vocabulary, 15 buckets held 0.75 GiB of logits).
        self.logits = torch.empty(max_batch, vocab, dtype=torch.float32, device=device)  # [max_batch, vocab]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        # LoRA (see the module doc): every row's slot and the tiles, sized for the largest bucket.
        self.max_loras = max_loras
        self.lora_buffer: torch.Tensor | None = None
        if max_loras is not None:
            # every bucket's layout is a prefix of this: rows and tiles only grow with the bucket
            total, _ = index_layout(max_batch, max_lora_tiles(max_batch, max_loras))
            self.lora_buffer = torch.zeros(total, dtype=torch.int32, device=device)  # [total]

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # fixed: kernels size their grids from it
            ntk_tables=None if self.ntk_tables is None else self.ntk_tables[:batch],
        )

    def _lora(self, batch: int) -> LoRAIndices:
        assert self.lora_buffer is not None and self.max_loras is not None
        return indices_from_buffer(self.lora_buffer, batch, max_lora_tiles(batch, self.max_loras))

    def _run(self, batch: int) -> torch.Tensor:
        extra = {} if self.lora_buffer is None else {"lora": self._lora(batch)}
        hidden = self.model(
            self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._metadata(batch), **extra
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (kernel compilation, autotuning) and capture, largest bucket first."""
        torch.cuda.synchronize()
        for batch in reversed(self.buckets):
            if self.lora_buffer is not None:  # this bucket's layout, no adapter row: a base-only warm-up
                self._stage_lora(batch, None, pinned=False)
            self._run(batch)  # warm-up outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[:batch].copy_(self._run(batch))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), list(self.buckets))

    def bucket_for(self, batch: int) -> int | None:
        if batch > self.buckets[-1]:
            return None
        return self.buckets[bisect_left(self.buckets, batch)]

    @torch.inference_mode()
    def replay(
        self,
        input_ids: list[int],  # [B]
        positions: np.ndarray,  # int64 [B]
        slots: np.ndarray,  # int64 [B]
        block_tables: np.ndarray,  # int32 [B, width], width <= max blocks per sequence
        ntk_tables: np.ndarray | None = None,  # int64 [B]: rotary table per row (None: table 0)
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,  # (rows [P], token ids [P]) on the device
        lora_slots: np.ndarray | None = None,  # int32 [B]: each row's adapter slot, -1 the base (None: all)
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` for a pure-decode batch (one token per sequence).

        Rows past ``B`` up to the bucket are pad rows: slot -1 (not stored), length 1, block 0.
        Block-table columns past ``width`` keep stale ids from earlier steps; kernels never
        read past a sequence's length, so only valid ids matter and stale ones are valid.
        ``pending``: input ids sampled by the step still in flight (async scheduling), written
        over rows ``pending[0]`` on the device.
        """
        batch = len(input_ids)
        bucket = self.bucket_for(batch)
        host = np.zeros((5, bucket), dtype=np.int64)  # ids, positions, slots, seq_lens, ntk tables
        host[0, :batch] = input_ids
        host[1, :batch] = positions
        host[2, :] = -1
        host[2, :batch] = slots
        host[3, :] = 1
        host[3, :batch] = positions + 1
        if ntk_tables is not None:  # pad rows read table 0
            host[4, :batch] = ntk_tables
        staged = torch.from_numpy(host)
        pinned = self.input_ids.is_cuda
        if pinned:  # asynchronous copies: the previous step may still be running (async scheduling)
            staged = staged.pin_memory()
        self.input_ids[:bucket].copy_(staged[0], non_blocking=True)
        self.positions[:bucket].copy_(staged[1], non_blocking=True)
        self.slot_mapping[:bucket].copy_(staged[2], non_blocking=True)
        self.seq_lens[:bucket].copy_(staged[3], non_blocking=True)
        if self.ntk_tables is not None:
            self.ntk_tables[:bucket].copy_(staged[4], non_blocking=True)
        if pending is not None:
            self.input_ids.index_copy_(0, *pending)
        width = block_tables.shape[1]
        tables = torch.from_numpy(block_tables)
        self.block_tables[:batch, :width].copy_(tables.pin_memory() if pinned else tables, non_blocking=True)
        self.block_tables[batch:bucket, 0] = 0
        if self.lora_buffer is not None:
            self._stage_lora(bucket, lora_slots, pinned)
        self.graphs[bucket].replay()
        return self.logits[:batch]

    def _stage_lora(self, bucket: int, lora_slots: np.ndarray | None, pinned: bool) -> None:
        """Each row's slot (pad and base rows -1), the tiles padded with empty ones, zero counters: one
        copy of the bucket's prefix of the buffer."""
        assert self.lora_buffer is not None and self.max_loras is not None
        tiles = max_lora_tiles(bucket, self.max_loras)
        total, _ = index_layout(bucket, tiles)
        host = torch.empty(total, dtype=torch.int32, pin_memory=pinned)  # [total]
        slots = np.empty(0, dtype=np.int32) if lora_slots is None else lora_slots
        fill_index_buffer(host.numpy(), slots, bucket, tiles)
        self.lora_buffer[:total].copy_(host, non_blocking=pinned)
