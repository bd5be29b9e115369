"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with static inputs.

Knows: how to capture ``model(...)`` + ``compute_logits`` for pure-decode batches (one new
token per sequence) into graphs sharing one memory pool, and how to feed a step into the
static buffers. Must not know: scheduling, sampling or the kernels' internals — it only
relies on the kernels being capture-safe (no host sync, grids fixed by the arguments) and on
the KV-store kernel skipping negative slots, which pad rows use.

LoRA (``max_loras``; ``QSERVE_LORA_GRAPHS=0`` turns them off): the graphs also take each row's adapter
slot and the rows' tiles as static inputs (``LoRAIndices`` views of fixed size: pad rows and base rows
have slot -1, unused tiles length 0), so steps mixing adapters and the base replay the same graph.
They are views of one int32 buffer, laid out per bucket (``lora_ops.index_layout``), which a replay
refills with one host-to-device copy (the split-K arrival counters included, copied as zeros).
Unless ``QSERVE_LORA_STAGE_ON_CHANGE=0`` (on by default since the H100 smoke at ``f609d24``) a replay whose bucket
and row slots equal the last staged ones copies nothing: the kernels leave the counters zero, so the buffer
still holds what was staged. Without ``max_loras`` nothing of this exists and the graphs are exactly the base model's.

Several rows per sequence (``query_len`` Q > 1; ``QSERVE_SPEC_GRAPHS=0`` turns them off): speculative
decoding's verify steps (each sequence's last known token and up to k drafts: Q = k + 1) and a draft
model's catch-up steps (Q = 2). A graph of B sequences has B * Q rows, sequence i owning rows
``[i * Q, (i + 1) * Q)`` (``query_start_loc`` fixed), ``max_query_len`` Q: attention takes the
prefill/extend kernel, whose grid depends on host integers only (token and sequence counts). A
sequence with n < Q new tokens puts them in the LAST n rows of its Q; the first Q - n are pad rows at
the Q - n positions just before its first new token (``static_rows``): with the sequence's true length
as ``seq_lens[i]``, the kernels see Q new tokens ending there, so the real rows get their real
positions and causal masks, and the pad rows (slot -1: their K/V are never stored) attend only to
keys already in the cache, never to a real row's. That needs ``seq_lens[i] >= Q`` (pad positions
>= 0; the runner falls back to the eager path otherwise). Pad sequences past B have length Q over
block 0. Logits are computed in the graph for the sampling rows only: ``sample_index`` (static,
padded with row 0) gathers them, at most ``max_sample_rows`` per graph, so the logits buffer can be
the decode graphs' own (``share``).

EAGLE heads (``hidden_taps``, the runner's when it returns hidden states for one): a multi-row graph
(or a decode graph, unless the engine's ``QSERVE_EAGLE_DECODE_GRAPHS=0``) also writes every row's hidden
states for the head into a static buffer ``spec_hidden``
(``[max rows, width]``, the model dtype): the final hidden states when ``hidden_taps`` is empty
(EAGLE, width = hidden), else the residual streams entering the layers ``hidden_taps``, concatenated
(EAGLE-3, width = len(taps) * hidden), as the eager forward computes them. ``spec_hidden_of`` gathers
a replayed step's real rows, in token order, into a new tensor, so the next replay cannot overwrite
what the head has not read yet. Without ``hidden_taps`` nothing of this exists.

Sharing (``share``): graphs of another ``DecodeGraphs`` (the target's decode graphs) lend their
memory pool and, where it is large enough, their logits buffer. Safe because every graph of the
process replays on one stream, never two at once, and nothing reads a graph's logits after the
next replay is enqueued (the sampler reads them within the step that replayed it).

Off CUDA, ``capture`` records nothing: each bucket's "graph" reruns the same static-buffer forward
eagerly at replay (``StaticReplay``), so the CPU tests run everything but the capture itself.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from bisect import bisect_left
from collections.abc import Callable, Iterator

import numpy as np
import torch

from qserve.runner.attn_metadata import AttentionMetadata
from quant_kernels.lora_ops import (
    LoRAIndices,
    LoRAOverlap,
    fill_index_buffer,
    index_layout,
    indices_from_buffer,
    max_lora_tiles,
)
from quant_kernels.switches import env_switch

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


# Opt-in ("1"): no cache emptying before each capture of a loop (vLLM skips it too). torch's
# ``torch.cuda.graph`` empties the device and pinned-host caches before every capture; with
# expandable segments each emptying unmaps memory the next capture maps again. Whether it shortens
# start-up (decode-graph capture took 10-19 s on an H100, mostly outside Python: py-spy, tenth
# session) is not measured yet.
KEEP_CACHE_ENV = "QSERVE_CAPTURE_KEEP_CACHE"
# "1" / unset: the LoRA index buffer is restaged only when a replay's (bucket, row slots) change (module doc)
LORA_STAGE_ON_CHANGE_ENV = "QSERVE_LORA_STAGE_ON_CHANGE"


@contextlib.contextmanager
def garbage_collected_first() -> Iterator[None]:
    """Around a loop of CUDA graph captures: collect the garbage now, and keep Python's collector off
    until the loop ends. Why: torch's ``torch.cuda.graph`` no longer collects before each capture, so
    an automatic collection that ran mid-capture could free a reference cycle holding an earlier
    engine's graphs or memory, whose CUDA calls (a graph destroyed, memory unmapped) are illegal while
    a capture is underway: the capture fails with ``cudaErrorStreamCaptureInvalidated``, and every
    later CUDA random-number use in the process with "Offset increment outside graph capture" (two
    smoke runs on an H100, bench/RESULTS.md ledger, `baacb83` and the tenth session). vLLM collects
    once and freezes the collector around its captures for the same reason."""
    keep_cache = env_switch(KEEP_CACHE_ENV, default=False)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    # a loop inside another's (or another thread's) keeps the outer one's patch and leaves it to it
    patch = keep_cache and torch.cuda.empty_cache is not _no_emptying
    emptying = torch.cuda.empty_cache, torch._C._host_emptyCache
    try:
        if patch:  # one emptying for the whole loop, none per capture
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
            torch.cuda.empty_cache = torch._C._host_emptyCache = _no_emptying
        yield
    finally:
        if patch:
            torch.cuda.empty_cache, torch._C._host_emptyCache = emptying
        if enabled:
            gc.enable()


def _no_emptying() -> None:
    pass


def capture_buckets(
    buckets: tuple[int, ...],
    capture: Callable[[int], object],
    pool: object,
    warm_up: Callable[[int], object] | None = None,
) -> tuple[dict[int, torch.cuda.CUDAGraph], object]:
    """One CUDA graph of ``capture(bucket)`` per bucket, largest first, each after a warm-up outside
    capture (``warm_up``, default ``capture``: compilation, autotuning) and all in one memory ``pool``
    (None: the first graph's). Returns (graph per bucket, the pool). The garbage is collected once
    before the loop and the collector stays off through it (``garbage_collected_first``)."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    torch.cuda.synchronize()
    with garbage_collected_first():
        for bucket in sorted(buckets, reverse=True):
            (warm_up or capture)(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                capture(bucket)
            if pool is None:
                pool = graph.pool()
            graphs[bucket] = graph
    torch.cuda.synchronize()
    return graphs, pool


def bucket_sizes(buckets: tuple[int, ...], largest: int) -> tuple[int, ...]:
    """The sizes graphs are captured for: ``buckets`` below ``largest``, then ``largest`` itself, ascending."""
    return tuple(sorted({b for b in buckets if b < largest} | {largest}))


def smallest_bucket(sizes: tuple[int, ...], count: int) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``count``; None past the largest."""
    if count > sizes[-1]:
        return None
    return sizes[bisect_left(sizes, count)]


class StaticReplay:
    """A bucket's "graph" off CUDA: ``replay()`` reruns the static-buffer forward it stands for."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def static_rows(counts: np.ndarray, query_len: int) -> np.ndarray:
    """int64 ``[T]``: the row of each new token in a multi-row graph's layout (``T = counts.sum()``,
    tokens sequence after sequence): sequence i's ``counts[i] <= query_len`` tokens fill the last
    ``counts[i]`` of its rows ``[i * query_len, (i + 1) * query_len)``."""
    num_tokens = int(counts.sum())
    ends = np.cumsum(counts)  # [S]
    within = np.arange(num_tokens, dtype=np.int64) - np.repeat(ends - counts, counts)  # [T]
    first_real = np.arange(len(counts), dtype=np.int64) * query_len + query_len - counts  # [S]
    return np.repeat(first_real, counts) + within


def static_positions(seq_lens: np.ndarray, query_len: int) -> np.ndarray:
    """int64 ``[B * query_len]``: every row's position when sequence i's rows end at ``seq_lens[i] - 1``
    (real rows get their own positions, pad rows the ones just before)."""
    return np.repeat(seq_lens - query_len, query_len) + np.tile(np.arange(query_len, dtype=np.int64), len(seq_lens))


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
        *,
        query_len: int = 1,
        max_sample_rows: int | None = None,
        share: DecodeGraphs | None = None,
        hidden_taps: tuple[int, ...] | None = None,
        lora_overlap: LoRAOverlap | None = None,
    ) -> None:
        """``max_num_seqs``: the largest bucket (sequences per graph). ``query_len``: rows per
        sequence (module doc); ``max_sample_rows``: with ``query_len > 1``, the most logit rows a
        graph computes (default: every row); ``share``: graphs whose pool and logits buffer these use;
        ``hidden_taps``: the graphs also write the hidden states an EAGLE head reads (module doc;
        None: they do not); not with ``max_loras``. ``lora_overlap``: with ``max_loras``, the LoRA
        shrinks are captured on its side stream beside the base GEMMs (``lora_ops.overlap_for``)."""
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len}")
        if query_len > 1 and max_loras is not None:
            raise ValueError("graphs of several rows per sequence take no LoRA slots")
        if max_loras is not None and hidden_taps is not None:
            raise ValueError("graphs that take LoRA slots return no EAGLE head's hidden states")
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.query_len = query_len
        self.buckets = bucket_sizes(buckets, max_num_seqs)
        max_batch = self.buckets[-1]
        max_rows = max_batch * query_len
        max_blocks = -(-max_model_len // block_size)
        # Pad sequences of a multi-row graph read the first blocks of their length query_len.
        self.pad_blocks = -(-query_len // block_size)
        int64 = {"dtype": torch.int64, "device": device}
        # Static inputs, shared by every graph (a graph of batch B reads the first B * Q rows).
        self.input_ids = torch.zeros(max_rows, **int64)  # [max_rows]
        self.positions = torch.zeros(max_rows, **int64)  # [max_rows]
        self.slot_mapping = torch.full((max_rows,), -1, **int64)  # [max_rows]; -1 = pad row
        self.seq_lens = torch.full((max_batch,), query_len, **int64)  # [max_batch]
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, **int64) * query_len  # [max_batch + 1]
        # Qwen v1 dynamic NTK: each row's rotary table (its sequence's alpha, fixed at prefill),
        # an input like the positions, so mixed-alpha batches replay the same graph.
        has_ntk = getattr(getattr(model, "rotary", None), "num_ntk_tables", 1) > 1
        self.ntk_tables = torch.zeros(max_rows, **int64) if has_ntk else None  # [max_rows]
        # Multi-row graphs: the rows whose logits are computed (the step's sampling rows, in order,
        # then row 0), at most max_sample_rows of them.
        self.max_sample_rows = max_batch if query_len == 1 else min(max_rows, max_sample_rows or max_rows)
        self.sample_index = torch.zeros(self.max_sample_rows, **int64) if query_len > 1 else None
        vocab = model.config.vocab_size
        # One output buffer for every graph: per-bucket outputs would each stay alive in the
        # pool (on a 152k vocabulary, 15 buckets held 0.75 GiB of logits).
        self.logits = _logits_buffer(self.max_sample_rows, vocab, device, share)  # [max_sample_rows, vocab]
        # EAGLE (module doc): every row's hidden states for the head, written by each replay.
        self.hidden_taps = None if hidden_taps is None else tuple(hidden_taps)
        self.spec_hidden: torch.Tensor | None = None
        if hidden_taps is not None:
            width = model.config.hidden_size * max(1, len(hidden_taps))
            self.spec_hidden = torch.empty(max_rows, width, dtype=model.dtype, device=device)  # [max_rows, width]
        self.graphs: dict[int, torch.cuda.CUDAGraph | StaticReplay] = {}
        self.pool = None if share is None else share.pool
        # LoRA (see the module doc): every row's slot and the tiles, sized for the largest bucket.
        self.max_loras = max_loras
        self.lora_overlap = lora_overlap
        self.lora_buffer: torch.Tensor | None = None
        if max_loras is not None:
            # every bucket's layout is a prefix of this: rows and tiles only grow with the bucket
            total, _ = index_layout(max_batch, max_lora_tiles(max_batch, max_loras))
            self.lora_buffer = torch.zeros(total, dtype=torch.int32, device=device)  # [total]
        # QSERVE_LORA_STAGE_ON_CHANGE: the (bucket, slots) the buffer holds now; a step with the same
        # stages nothing (the kernels leave their counters zero, so a replay leaves the buffer unchanged)
        self._lora_staged: tuple[int, bytes] | None = None
        self._lora_stage_on_change = env_switch(LORA_STAGE_ON_CHANGE_ENV, default=True)

    def sample_rows_of(self, batch: int) -> int:
        """Logit rows the graph of ``batch`` sequences computes."""
        return min(batch * self.query_len, self.max_sample_rows)

    def _metadata(self, batch: int) -> AttentionMetadata:
        rows = batch * self.query_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            max_query_len=self.query_len,
            max_seq_len=self.max_model_len,  # fixed: kernels size their grids from it
            ntk_tables=None if self.ntk_tables is None else self.ntk_tables[:rows],
        )

    def _lora(self, batch: int) -> LoRAIndices:
        assert self.lora_buffer is not None and self.max_loras is not None
        tiles = max_lora_tiles(batch, self.max_loras)
        return indices_from_buffer(self.lora_buffer, batch, tiles, overlap=self.lora_overlap)

    def _run(self, batch: int) -> torch.Tensor:
        extra = {} if self.lora_buffer is None else {"lora": self._lora(batch)}
        rows = batch * self.query_len
        inputs = (self.input_ids[:rows], self.positions[:rows], self.kv_caches, self._metadata(batch))
        if self.hidden_taps:  # EAGLE-3: the residual streams entering the tapped layers
            hidden, tapped = self.model.forward_with_taps(*inputs, self.hidden_taps)  # [rows, hidden], [rows, width]
            self.spec_hidden[:rows].copy_(tapped)
        else:
            hidden = self.model(*inputs, **extra)  # [rows, hidden]
            if self.spec_hidden is not None:  # EAGLE: the final hidden states themselves
                self.spec_hidden[:rows].copy_(hidden)
        if self.sample_index is not None:  # the sampling rows only
            hidden = hidden.index_select(0, self.sample_index[: self.sample_rows_of(batch)])  # [R, hidden]
        return self.model.compute_logits(hidden)

    def _run_into_logits(self, batch: int) -> None:
        self.logits[: self.sample_rows_of(batch)].copy_(self._run(batch))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (kernel compilation, autotuning) and capture, largest bucket first (off CUDA:
        ``StaticReplay`` stand-ins, see the module doc)."""
        kind = "decode" if self.query_len == 1 else f"{self.query_len}-row"
        if self.input_ids.device.type != "cuda":
            for batch in self.buckets:
                self.graphs[batch] = StaticReplay(lambda b=batch: self._run_into_logits(b))
            logger.info("%s graphs replayed eagerly off CUDA (batch sizes %s)", kind, list(self.buckets))
            return

        def warm_up(batch: int) -> None:
            if self.lora_buffer is not None:  # this bucket's layout, no adapter row: a base-only warm-up
                self._stage_lora(batch, None, pinned=False)
            self._run(batch)

        graphs, self.pool = capture_buckets(self.buckets, self._run_into_logits, self.pool, warm_up)
        self.graphs.update(graphs)
        logger.info("captured %d %s CUDA graphs (batch sizes %s)", len(self.graphs), kind, list(self.buckets))

    def bucket_for(self, batch: int) -> int | None:
        return smallest_bucket(self.buckets, batch)

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
        """Logits ``[B, vocab]`` for a pure-decode batch (one token per sequence; ``query_len`` 1).

        Rows past ``B`` up to the bucket are pad rows: slot -1 (not stored), length 1, block 0.
        Block-table columns past ``width`` keep stale ids from earlier steps; kernels never
        read past a sequence's length, so only valid ids matter and stale ones are valid.
        ``pending``: input ids sampled by the step still in flight (async scheduling), written
        over rows ``pending[0]`` on the device.
        """
        assert self.query_len == 1, "multi-row graphs replay through replay_rows"
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

    def fits_rows(self, counts: np.ndarray, seq_lens: np.ndarray, num_sample_rows: int) -> bool:
        """Whether a step of ``counts`` new tokens per sequence (``seq_lens`` after it) and
        ``num_sample_rows`` logit rows (at least one: a step sampling nothing computes no logits)
        can replay a multi-row graph (module doc)."""
        bucket = self.bucket_for(len(counts))
        return (
            bucket is not None
            and int(counts.max()) <= self.query_len
            and int(seq_lens.min()) >= self.query_len
            and 0 < num_sample_rows <= self.sample_rows_of(bucket)
        )

    @torch.inference_mode()
    def replay_rows(
        self,
        input_ids: list[int],  # [T]
        counts: np.ndarray,  # int64 [S]: new tokens per sequence, each in [1, query_len]
        seq_lens: np.ndarray,  # int64 [S]: context length after the step, each >= query_len
        slots: np.ndarray,  # int64 [T]
        block_tables: np.ndarray,  # int32 [S, width]
        sample_rows: np.ndarray,  # int64 [N]: token indices (in ``input_ids``) whose logits are wanted
        ntk_tables: np.ndarray | None = None,  # int64 [S]: each sequence's rotary table (None: table 0)
        device_inputs: tuple[np.ndarray, torch.Tensor] | None = None,  # (token indices [D], ids [D] on the device)
    ) -> torch.Tensor:
        """Logits ``[N, vocab]`` of ``sample_rows`` for a step that ``fits_rows`` (``query_len > 1``).

        ``device_inputs``: input ids left on the device (drafts, ``SchedulerOutput.spec_device_drafts``),
        written over their tokens' rows there after the host's ids.

        Tokens go to their ``static_rows``; pad rows get input id 0, slot -1 (nothing stored) and the
        positions before their sequence's first new token (``static_positions``); pad sequences past
        S have length ``query_len`` over block 0. Block-table columns past ``width`` keep stale (valid)
        ids, as in ``replay``.
        """
        q = self.query_len
        num_seqs = len(counts)
        bucket = self.bucket_for(num_seqs)
        rows = bucket * q
        num_sample = len(sample_rows)
        row_of_token = static_rows(counts, q)  # [T]
        lens = np.full(bucket, q, dtype=np.int64)  # [bucket]
        lens[:num_seqs] = seq_lens
        host = np.zeros((4, rows), dtype=np.int64)  # ids, positions, slots, ntk tables
        host[0, row_of_token] = input_ids
        host[1] = static_positions(lens, q)
        host[2] = -1
        host[2, row_of_token] = slots
        if ntk_tables is not None:  # pad sequences read table 0
            host[3, : num_seqs * q] = np.repeat(ntk_tables, q)
        index = np.zeros(self.sample_rows_of(bucket), dtype=np.int64)  # [R]; rows past N: row 0
        index[:num_sample] = row_of_token[sample_rows]
        staged = [torch.from_numpy(host), torch.from_numpy(lens), torch.from_numpy(index)]
        tables = torch.from_numpy(block_tables)
        pinned = self.input_ids.is_cuda
        if pinned:  # asynchronous copies, as in replay
            staged = [t.pin_memory() for t in staged]
            tables = tables.pin_memory()
        self.input_ids[:rows].copy_(staged[0][0], non_blocking=True)
        if device_inputs is not None and len(device_inputs[0]):  # ids the host does not have: drafts on the device
            where = torch.from_numpy(row_of_token[device_inputs[0]])  # [D]
            where = where.pin_memory().to(self.input_ids.device, non_blocking=True) if pinned else where
            self.input_ids.index_copy_(0, where, device_inputs[1])
        self.positions[:rows].copy_(staged[0][1], non_blocking=True)
        self.slot_mapping[:rows].copy_(staged[0][2], non_blocking=True)
        if self.ntk_tables is not None:
            self.ntk_tables[:rows].copy_(staged[0][3], non_blocking=True)
        self.seq_lens[:bucket].copy_(staged[1], non_blocking=True)
        assert self.sample_index is not None
        self.sample_index[: len(index)].copy_(staged[2], non_blocking=True)
        self.block_tables[:num_seqs, : block_tables.shape[1]].copy_(tables, non_blocking=True)
        self.block_tables[num_seqs:bucket, : self.pad_blocks] = 0
        self.graphs[bucket].replay()
        return self.logits[:num_sample]

    def spec_hidden_of(self, counts: np.ndarray) -> torch.Tensor:
        """``[T, width]``: the EAGLE head's hidden states of the real rows of the step just replayed
        by ``replay_rows`` with these ``counts`` (by ``replay``: one per sequence), in token order (the
        eager forward's order), copied out of the static buffer (module doc)."""
        assert self.spec_hidden is not None, "these graphs write no hidden states (hidden_taps)"
        if self.query_len == 1:  # a decode graph: sequence i's one token is row i, no index to stage
            return self.spec_hidden[: len(counts)].clone()  # [S, width]
        rows = torch.from_numpy(static_rows(counts, self.query_len))  # [T]
        if self.spec_hidden.is_cuda:  # an asynchronous copy, as replay_rows' inputs
            rows = rows.pin_memory().to(self.spec_hidden.device, non_blocking=True)
        return self.spec_hidden.index_select(0, rows)  # [T, width]

    def _stage_lora(self, bucket: int, lora_slots: np.ndarray | None, pinned: bool) -> None:
        """Each row's slot (pad and base rows -1), the tiles padded with empty ones, zero counters: one
        copy of the bucket's prefix of the buffer. Unless ``QSERVE_LORA_STAGE_ON_CHANGE=0``, nothing when the
        buffer already holds this bucket's layout of these slots: a decode batch keeps its rows' adapters
        from step to step, and building the layout on the host was 0.35 ms of a batch-32 step's idle GPU
        time (bench/RESULTS.md, issue 30). Replays leave the buffer as staged: the split shrink's last
        program resets its counter."""
        assert self.lora_buffer is not None and self.max_loras is not None
        slots = np.empty(0, dtype=np.int32) if lora_slots is None else np.asarray(lora_slots, dtype=np.int32)
        key = (bucket, slots.tobytes()) if self._lora_stage_on_change else None
        if key is not None and key == self._lora_staged:
            return
        tiles = max_lora_tiles(bucket, self.max_loras)
        total, _ = index_layout(bucket, tiles)
        host = torch.empty(total, dtype=torch.int32, pin_memory=pinned)  # [total]
        fill_index_buffer(host.numpy(), slots, bucket, tiles)
        self.lora_buffer[:total].copy_(host, non_blocking=pinned)
        self._lora_staged = key


def _logits_buffer(rows: int, vocab: int, device: torch.device, share: DecodeGraphs | None) -> torch.Tensor:
    """float32 ``[rows, vocab]``: a view of ``share``'s logits buffer where it holds as many numbers
    (module doc: sharing), else a new one."""
    if share is not None and share.logits.device == device and share.logits.numel() >= rows * vocab:
        return share.logits.view(-1)[: rows * vocab].view(rows, vocab)
    return torch.empty(rows, vocab, dtype=torch.float32, device=device)
