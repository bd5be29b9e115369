"""The model runner: turns a ``SchedulerOutput`` into one batched forward pass and a
``RunnerOutput``.

Knows: how to lay out a step's tokens (input ids, positions, slot mapping, block tables), the
paged KV tensors, and when to compute logits (sampling rows and prompt-logprob rows). Must not
know: scheduling policy, text, stop conditions or the HTTP layer. One forward per step over all
scheduled tokens; Python loops here run over sequences (never over tokens: positions, slots
and padded block tables are computed with numpy from per-sequence scalars), never over
weights or inside layers.

Async scheduling: ``launch`` enqueues a step and returns a ``LaunchedStep`` without waiting for
the device; its sampled ids are copied to pinned host memory behind a CUDA event, and
``LaunchedStep.result()`` waits for that event only. A step scheduled while the previous one is
still in flight has input positions whose token the host does not know yet (the scheduler's
placeholders): they are filled on the device from the previous step's sampled ids, so no token
makes a round trip through the host. ``execute`` is ``launch(...).result()``.

Pooling (embedding requests, ``ScheduledSequence.pooling``): a step that computes such a
sequence's last prompt token returns that token's final hidden state (float32) in
``RunnerOutput.hidden_states``; such a step runs eagerly (a decode graph returns logits only).

LoRA (``enable_lora``): with a ``LoRAManager`` set, a step whose sequences use adapters puts them in
device slots and passes each row's slot to the model (``LoRAIndices``, the forward's explicit
argument); such a step runs eagerly, or, with decode graphs captured for LoRA (the default; ``QSERVE_LORA_GRAPHS=0`` turns them off),
replays them with each row's slot as a graph input. A step with no adapter row, and every step without
a manager, runs exactly as before.

Speculative decoding (``SchedulerOutput.num_spec_tokens > 0``): a sequence with k draft tokens
gets logits at its last k + 1 rows and ``_verify`` runs the rejection sampler
(``qserve.runner.rejection_sampler``) over them; its emitted tokens reach the host inside the
launch. Such a step runs eagerly, or, with multi-row graphs captured (``capture_row_graphs``, unless
``QSERVE_SPEC_GRAPHS=0``: up to ``query_len`` new tokens per sequence, pad rows where a sequence has
fewer, see ``qserve.runner.cuda_graphs``), replays one when it fits (``uses_row_graph``); a draft
model's runner uses them for its catch-up steps. Steps without drafts take exactly the path they
take without speculation (a pure decode never takes a multi-row graph).

EAGLE heads (``enable_spec_hidden_states``, off by default): a step whose
``SchedulerOutput.spec_hidden_states`` is set returns the target's hidden states of all its tokens in
``RunnerOutput.spec_hidden_states`` (the final ones, or for EAGLE-3 the residual streams entering the
tapped layers, concatenated); every other step is unchanged. Such a step runs eagerly, except a
verify step that fits the multi-row graphs when they were captured after ``enable_spec_hidden_states``
(the default; ``QSERVE_SPEC_GRAPHS=0`` turns them off): those graphs write the same hidden states
into a static buffer (``DecodeGraphs.hidden_taps``), and the step replays one and returns them. A
plain decode step that asks for them (while the engine speculates: every step of a sequence the
head backs off from, or that got no drafts) replays a decode graph only when the decode graphs were
captured with the same taps (``capture_decode_graphs(hidden_taps=...)``: the engine's default,
``QSERVE_EAGLE_DECODE_GRAPHS=0`` opts out); otherwise it runs eagerly (EAGLE at batch 1 averaged 61 ms a step for
a 14B model on an H100, against 4.8 ms without speculation: bench/RESULTS.md, ninth session).

Piecewise CUDA graphs (``capture_piecewise_graphs``, on CUDA unless ``QSERVE_PIECEWISE_GRAPHS=0``): a step
that replays no decode or row graph (mixed and prefill steps) runs its layers' non-attention parts as
graphs per token-count bucket with the attentions eager between them (``qserve.runner.piecewise_graphs``),
unless it has prompt-logprob or pooled rows, an adapter row, EAGLE hidden states or draft tokens
(``uses_piecewise_graph``), which run eagerly as before; with ``piecewise_takes_spec_steps`` (the engine's
default; ``QSERVE_PIECEWISE_SPEC=0`` opts out) steps with draft tokens, and steps asking for an EAGLE (not EAGLE-3)
head's hidden states (the pieces' output, copied out), take the pieces too.

Swap preemption: a step's ``blocks_to_swap_out`` / ``blocks_to_swap_in`` are copied by the
``KVSwapper`` (``enable_swap``) at the start of ``launch``, before anything of the step's forward
is enqueued (qserve.runner.kv_swap says why that order is enough, with or without a step in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from qserve.config import ModelConfig
from qserve.runner.attn_metadata import AttentionMetadata
from qserve.runner.cuda_graphs import DecodeGraphs
from qserve.runner.kv_swap import KVSwapper
from qserve.runner.ntk_index import ntk_alpha_indices
from qserve.runner.piecewise_graphs import PiecewiseGraphs
from qserve.runner.rejection_sampler import accepted_tokens, verify_rows
from qserve.runner.sampler import (
    PROMPT_LOGPROBS_CHUNK_ROWS,
    Sampler,
    build_sampling_metadata,
    compute_prompt_logprobs,
    gather_logprobs,
    mask_padded_vocab,
    pending_output_slots,
)
from qserve.scheduler.output import RunnerOutput, ScheduledSequence, SchedulerOutput, TokenLogprobs
from quant_kernels.lora_ops import LoRAIndices, build_lora_indices
from quant_kernels.reference_kv_int4 import cache_head_size


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> tuple[int, ...]:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` (int4 caches: uint8 rows of
    ``head_dim // 2 + 4`` bytes, see ``quant_kernels.reference_kv_int4``)."""
    return (num_blocks, block_size, config.num_kv_heads, cache_head_size(config.head_dim, dtype))


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key, value) pair per layer, each ``kv_cache_shape(...)``."""
    shape = kv_cache_shape(config, num_blocks, block_size, dtype)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]


def _token_at(seq: ScheduledSequence) -> int:
    """The token id at ``seq.start_position`` (a decode step's only input token); 0 for a token
    still being sampled by the step in flight (async scheduling), which the device fills in."""
    prompt = seq.prompt_token_ids
    position = seq.start_position
    if position < len(prompt):
        return prompt[position]
    index = position - len(prompt)
    output = seq.output_token_ids
    return output[index] if index < len(output) else 0


def _num_pending(seq: ScheduledSequence) -> int:
    """Input tokens of this step that the host does not know yet (sampled by the step in flight;
    draft tokens are known)."""
    end = seq.start_position + seq.num_new_tokens - len(seq.spec_token_ids)
    return max(0, end - len(seq.prompt_token_ids) - len(seq.output_token_ids))


def _input_ids(seq: ScheduledSequence) -> list[int]:
    """``seq.input_token_ids()``, with 0 for a pending last token (filled on the device)."""
    ids = seq.input_token_ids()
    missing = seq.num_new_tokens - len(ids)
    return ids + [0] * missing if missing else ids


@dataclass(eq=False)
class LaunchedStep:
    """A step enqueued on the device. ``result()`` waits for its sampled ids (only them: the
    event follows their copy to the host) and returns its ``RunnerOutput`` (cached)."""

    request_ids: list[str]  # the sampling sequences, one per row of ``sampled``
    sampled: torch.Tensor | None = None  # [R] int64 on the device: later steps' pending inputs
    host_sampled: torch.Tensor | None = None  # [R] int64 on the host (pinned on CUDA), valid once ready
    ready: torch.cuda.Event | None = None  # recorded after the copy to host_sampled (CUDA only)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Pooling sequences' final hidden states: (request ids, [H, hidden] float32 on the host, pinned
    # on CUDA), copied before ``ready`` is recorded, so valid once it is.
    pooled: tuple[list[str], torch.Tensor] | None = None
    # Speculative decoding (host lists, final at launch): every token emitted per sequence that
    # had drafts, and their logprobs when asked for (RunnerOutput's fields of the same names).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # EAGLE: [num_tokens, width] on the device (RunnerOutput.spec_hidden_states), or None
    spec_hidden_states: torch.Tensor | None = None
    _output: RunnerOutput | None = None
    _rows: dict[str, int] | None = None

    def row_of(self, request_id: str) -> int:
        if self._rows is None:
            self._rows = {rid: row for row, rid in enumerate(self.request_ids)}
        return self._rows[request_id]

    def result(self) -> RunnerOutput:
        if self._output is None:
            if self.ready is not None:
                self.ready.synchronize()
            tokens = [] if self.host_sampled is None else self.host_sampled.tolist()
            hidden_states = {} if self.pooled is None else dict(zip(self.pooled[0], self.pooled[1].tolist()))
            self._output = RunnerOutput(
                dict(zip(self.request_ids, tokens)),
                self.logprobs,
                self.prompt_logprobs,
                hidden_states,
                self.spec_token_ids,
                self.spec_logprobs,
                self.spec_hidden_states,
            )
        return self._output


def spec_sample_rows(sequences: list[ScheduledSequence], ends: np.ndarray) -> np.ndarray:
    """Token indices of a speculative step's sampling rows: the last ``k + 1`` tokens of each
    sampling sequence with ``k`` drafts (its last known token, then each draft), in order."""
    rows = [
        np.arange(int(end) - len(seq.spec_token_ids) - 1, int(end), dtype=np.int64)
        for seq, end in zip(sequences, ends)
        if seq.sample
    ]
    return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)  # [N]


def device_draft_slots(sequences: list[ScheduledSequence], ends: np.ndarray, width: int, rows: dict[str, int]):
    """Drafts left on the device (``SchedulerOutput.spec_device_drafts``, ``width`` columns, a row per
    sequence in ``rows``): (the token index of every draft among the step's inputs ``[D]``, its index in
    the flattened drafts ``[D]``), int64 host arrays."""
    index, source = [], []
    for seq, end in zip(sequences, ends):
        count = len(seq.spec_token_ids)
        if count:
            base = rows[seq.request_id] * width
            index.append(np.arange(int(end) - count, int(end), dtype=np.int64))
            source.append(np.arange(base, base + count, dtype=np.int64))
    if not index:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(index), np.concatenate(source)


def pad_block_tables(table_lens: np.ndarray, flat_tables: np.ndarray) -> np.ndarray:
    """Concatenated block tables -> one int32 ``[S, max_blocks]`` array (0 = unused entry),
    without a per-row Python loop."""
    num_seqs = len(table_lens)
    block_tables = np.zeros((num_seqs, int(table_lens.max())), dtype=np.int32)  # [S, max_blocks]
    rows = np.repeat(np.arange(num_seqs), table_lens)  # [sum(lens)]
    cols = np.arange(len(flat_tables)) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)
    block_tables[rows, cols] = flat_tables
    return block_tables


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (shares memory on CPU). On CUDA the copy is
    asynchronous from pinned memory: a blocking copy would wait for the step in flight."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)


def uses_decode_graph(
    graphs: DecodeGraphs, is_decode: bool, num_sample_rows: int, num_seqs: int, has_prompt_logprobs: bool
) -> bool:
    """Whether a step replays a captured decode graph: one new token per sequence, every one
    sampled, no prompt logprobs nor pooled hidden states (``has_prompt_logprobs`` covers both:
    the graph returns logits only), and a bucket large enough. Per-sequence rotary tables (Qwen v1
    dynamic NTK) are a graph input, so they do not force the eager path."""
    return (
        is_decode
        and num_sample_rows == num_seqs
        and not has_prompt_logprobs
        and graphs.bucket_for(num_seqs) is not None
    )


def uses_row_graph(
    graphs: DecodeGraphs,
    counts: np.ndarray,
    seq_lens: np.ndarray,
    num_sample_rows: int,
    has_prompt_logprobs: bool,
    has_pending: bool,
) -> bool:
    """Whether a step that is not a pure decode replays a multi-row graph (``query_len`` > 1 rows per
    sequence): every sequence has at most ``query_len`` new tokens and a context of at least that
    (``DecodeGraphs.fits_rows``), no prompt logprobs nor pooled hidden states (``has_prompt_logprobs``
    covers both), and no input still sampled by the step in flight (verify steps never have one)."""
    return not has_prompt_logprobs and not has_pending and graphs.fits_rows(counts, seq_lens, num_sample_rows)


def uses_piecewise_graph(
    graphs: PiecewiseGraphs,
    num_tokens: int,
    has_prompt_logprobs: bool,
    has_lora: bool,
    spec_taps: tuple[int, ...] | None,
    has_spec_tokens: bool,
    takes_spec_steps: bool = False,
) -> bool:
    """Whether a step that replays no decode or row graph runs through the piecewise graphs: no
    prompt logprobs nor pooled hidden states (``has_prompt_logprobs`` covers both), no adapter row,
    and a bucket large enough (qserve.runner.piecewise_graphs). Speculative steps only with
    ``takes_spec_steps`` (``ModelRunner.piecewise_takes_spec_steps``): draft tokens (a verify that fits no
    row graph, e.g. beside a prompt chunk: its logit rows are any rows of the pieces' output, as in
    the eager forward) and an EAGLE head's hidden states (``spec_taps`` empty: the pieces' output
    itself); EAGLE-3's tapped streams (``spec_taps`` non-empty) are not their output, never."""
    if spec_taps is not None and (spec_taps or not takes_spec_steps):
        return False
    return (
        not (has_prompt_logprobs or has_lora or (has_spec_tokens and not takes_spec_steps))
        and graphs.bucket_for(num_tokens) is not None
    )


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        valid_vocab_size: int | None = None,
    ) -> None:
        """``valid_vocab_size``: the tokenizer's id count when the model's vocabulary is padded
        past it (those ids are never sampled nor reported); None: every id is a token."""
        self.model = model
        self.config = config
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.valid_vocab_size = valid_vocab_size
        self.sampler = Sampler(seed=seed, valid_vocab_size=valid_vocab_size)
        self.decode_graphs: DecodeGraphs | None = None
        # Graphs of several rows per sequence (speculative verify / a draft's catch-up; opt-in).
        self.row_graphs: DecodeGraphs | None = None
        # Steps carrying prefill, by token-count bucket (on CUDA unless QSERVE_PIECEWISE_GRAPHS=0).
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.kv_swapper: KVSwapper | None = None  # swap preemption's host pool (enable_swap)
        self.lora_manager = None  # qserve.lora.slots.LoRAManager (enable_lora)
        # Qwen v1 dynamic NTK: how many rotary tables the model holds (1: none to pick from).
        self.num_ntk_tables = getattr(getattr(model, "rotary", None), "num_ntk_tables", 1)
        # EAGLE: None (off), () (the final hidden states) or the layers whose input streams are tapped
        self.spec_hidden_layers: tuple[int, ...] | None = None
        # Piecewise graphs also take speculative steps that fit no decode or row graph (the engine
        # sets it unless QSERVE_PIECEWISE_SPEC=0; otherwise those steps run eagerly): steps with draft
        # tokens, and steps asking for an EAGLE (not EAGLE-3) head's hidden states.
        self.piecewise_takes_spec_steps = False

    def enable_spec_hidden_states(self, taps: tuple[int, ...]) -> None:
        """Steps asking for it (``SchedulerOutput.spec_hidden_states``) return the target's hidden
        states of every token: the final ones when ``taps`` is empty (EAGLE), else the residual
        streams entering the layers ``taps`` (EAGLE-3), concatenated."""
        for layer in taps:
            if not 0 <= layer < self.config.num_layers:
                raise ValueError(
                    f"hidden-state tap layer {layer} is outside the model's {self.config.num_layers} layers"
                )
        self.spec_hidden_layers = tuple(taps)

    def set_valid_vocab_size(self, valid_vocab_size: int | None) -> None:
        """Ids at or past ``valid_vocab_size`` (model rows beyond the tokenizer) are never
        sampled nor reported in logprobs or prompt logprobs; None lifts the mask."""
        self.valid_vocab_size = self.sampler.valid_vocab_size = valid_vocab_size

    def enable_swap(self, num_host_blocks: int) -> KVSwapper:
        """Allocate a host pool of ``num_host_blocks`` KV blocks (pinned on CUDA) for swap preemption."""
        self.kv_swapper = KVSwapper(self.kv_caches, num_host_blocks, self.device)
        return self.kv_swapper

    def capture_decode_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_loras: int | None = None,
        share: DecodeGraphs | None = None,
        hidden_taps: tuple[int, ...] | None = None,
    ) -> None:
        """Capture CUDA graphs for pure-decode steps (after kernels are warm; before serving);
        ``max_loras``: graphs that take each row's LoRA adapter slot too (cuda_graphs' module doc);
        ``share``: another runner's graphs whose pool and logits buffer these use; ``hidden_taps``:
        graphs that also write an EAGLE head's hidden states (``enable_spec_hidden_states``' taps), so
        a plain decode step asking for them replays one instead of running eagerly."""
        extra = {}
        if max_loras is not None:
            overlap = None if self.lora_manager is None else self.lora_manager.overlap  # QSERVE_LORA_OVERLAP
            extra = {"max_loras": max_loras, "lora_overlap": overlap}
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            max_num_seqs,
            max_model_len,
            self.block_size,
            self.device,
            share=share,
            hidden_taps=hidden_taps,
            **extra,
        )
        self.decode_graphs.capture()

    def capture_row_graphs(
        self,
        query_len: int,
        max_num_seqs: int,
        max_model_len: int,
        max_sample_rows: int | None = None,
        share: DecodeGraphs | None = None,
    ) -> None:
        """Capture CUDA graphs for steps of up to ``query_len`` new tokens per sequence and up to
        ``max_num_seqs`` sequences (speculative verify: k + 1; cuda_graphs' module doc), computing at
        most ``max_sample_rows`` logit rows; ``share``: graphs whose pool and logits buffer they use
        (default: this runner's decode graphs). After ``enable_spec_hidden_states`` the graphs also
        write the hidden states an EAGLE head reads (``DecodeGraphs.hidden_taps``), so verify steps
        asking for them replay too."""
        if query_len < 2:
            raise ValueError(f"row graphs need query_len >= 2 (a decode graph serves 1), got {query_len}")
        share = share or self.decode_graphs
        if max_sample_rows is None and share is not None:
            max_sample_rows = share.max_sample_rows
        self.row_graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            max_num_seqs,
            max_model_len,
            self.block_size,
            self.device,
            query_len=query_len,
            max_sample_rows=max_sample_rows,
            share=share,
            hidden_taps=self.spec_hidden_layers,
        )
        self.row_graphs.capture()

    def capture_piecewise_graphs(
        self, max_num_tokens: int, buckets: tuple[int, ...] | None = None, share: DecodeGraphs | None = None
    ) -> None:
        """Capture piecewise CUDA graphs (qserve.runner.piecewise_graphs) for steps of up to
        ``max_num_tokens`` tokens that replay no decode graph; ``share``: graphs whose memory pool
        they use (default: this runner's decode graphs)."""
        extra = {} if buckets is None else {"buckets": buckets}
        self.piecewise_graphs = PiecewiseGraphs(
            self.model, self.kv_caches, max_num_tokens, self.device, share=share or self.decode_graphs, **extra
        )
        self.piecewise_graphs.capture()

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step and wait for its output."""
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue one step; ``previous`` is the step still in flight, whose sampled ids are the
        inputs this step's scheduler left as placeholders."""
        if scheduler_output.blocks_to_swap_out or scheduler_output.blocks_to_swap_in:
            swapper = self.kv_swapper
            if swapper is None:
                raise RuntimeError("the scheduler swapped KV blocks but this runner has no host pool (enable_swap)")
            if scheduler_output.blocks_to_swap_out:  # first: this step may reuse the pages they free
                swapper.swap_out(scheduler_output.blocks_to_swap_out)
            if scheduler_output.blocks_to_swap_in:
                swapper.swap_in(scheduler_output.blocks_to_swap_in)
        sequences = scheduler_output.sequences
        if not sequences:
            return LaunchedStep([])
        num_seqs = len(sequences)
        block_size = self.block_size
        # Per-sequence scalars, gathered once; everything per token is numpy from here on.
        starts = np.fromiter((seq.start_position for seq in sequences), np.int64, num_seqs)  # [S]
        counts = np.fromiter((seq.num_new_tokens for seq in sequences), np.int64, num_seqs)  # [S]
        sample_mask = np.fromiter((seq.sample for seq in sequences), np.bool_, num_seqs)  # [S]
        tables = [seq.block_ids for seq in sequences]
        table_lens = np.fromiter(map(len, tables), np.int64, num_seqs)  # [S]
        table_offsets = np.cumsum(table_lens) - table_lens  # [S] start of each table in flat_tables
        flat_tables = np.fromiter(chain.from_iterable(tables), np.int64, int(table_lens.sum()))  # [sum(lens)]
        ends = np.cumsum(counts)  # [S] query_start_loc[1:]
        num_tokens = int(ends[-1])
        is_decode = num_tokens == num_seqs  # one new token per sequence
        pending = None  # (token indices [P], the previous step's rows [P]) of inputs sampled in flight
        if previous is not None and previous.request_ids:
            rows = [
                (int(ends[i]) - 1, previous.row_of(seq.request_id))
                for i, seq in enumerate(sequences)
                if _num_pending(seq)
            ]
            if rows:
                assert previous.sampled is not None
                index = _to_device(np.array([r[0] for r in rows], dtype=np.int64), self.device)  # [P]
                source = _to_device(np.array([r[1] for r in rows], dtype=np.int64), self.device)  # [P]
                pending = (index, previous.sampled.index_select(0, source))  # [P], [P] int64
        # Drafts left on the device (spec_device_drafts): their input ids are placeholders here, written
        # over on the device (token indices [D] on the host, ids [D] on the device)
        draft_inputs = None
        device_drafts = scheduler_output.spec_device_drafts
        if device_drafts is not None:
            index, source = device_draft_slots(sequences, ends, device_drafts.drafts.shape[1], device_drafts.rows)
            values = device_drafts.drafts.reshape(-1).index_select(0, _to_device(source, self.device))  # [D]
            draft_inputs = (index, values)
            assert pending is None, "drafts after a token in flight"
        if is_decode:
            input_ids = [_token_at(seq) for seq in sequences]
            positions = starts  # [T], T == S
            token_tables = table_offsets  # [T] start of each token's table in flat_tables
        else:
            input_ids = list(chain.from_iterable(_input_ids(seq) for seq in sequences))
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(ends - counts - starts, counts)  # [T]
            token_tables = np.repeat(table_offsets, counts)  # [T]
        block_index = positions // block_size  # [T] logical block of each token
        assert (block_index < (table_lens if is_decode else np.repeat(table_lens, counts))).all(), "short block table"
        slots = flat_tables[token_tables + block_index] * block_size + positions % block_size  # [T]
        seq_lens = starts + counts  # [S]
        sample_rows = (ends - 1)[sample_mask]  # [R] the last token of each sampling sequence
        if scheduler_output.num_spec_tokens:  # a sequence with k drafts samples its last k + 1 rows
            sample_rows = spec_sample_rows(sequences, ends)  # [N]
        ntk_tables = None  # Qwen v1 dynamic NTK: each sequence's table, fixed by its prompt length
        if self.num_ntk_tables > 1:
            prompt_lens = np.fromiter((len(seq.prompt_token_ids) for seq in sequences), np.int64, num_seqs)  # [S]
            per_seq = np.minimum(ntk_alpha_indices(prompt_lens, self.config.seq_length), self.num_ntk_tables - 1)
            ntk_tables = per_seq if is_decode else np.repeat(per_seq, counts)  # [T] int64

        prompt_rows: list[int] = []  # token indices needing prompt logprobs
        prompt_targets: list[int] = []
        prompt_owners: list[tuple[str, int]] = []  # (request_id, k) per prompt-logprob row
        offset = 0
        for seq in sequences:
            k = seq.sampling_params.prompt_logprobs
            if k is not None:
                start, count = seq.start_position, seq.num_new_tokens
                num_prompt = len(seq.prompt_token_ids)
                for p in range(start, min(start + count, num_prompt - 1)):
                    prompt_rows.append(offset + p - start)
                    prompt_targets.append(seq.prompt_token_ids[p + 1])
                    prompt_owners.append((seq.request_id, k))
            offset += seq.num_new_tokens
        # Embedding requests whose last prompt token is computed by this step: its final hidden
        # state is the result (a later decode step of one, under async scheduling, is not).
        pool_rows = [
            (int(ends[i]) - 1, seq.request_id)
            for i, seq in enumerate(sequences)
            if seq.pooling and seq.start_position + seq.num_new_tokens == len(seq.prompt_token_ids)
        ]

        lora_slots = lora = None
        if self.lora_manager is not None:  # each sequence's adapter slot; None when no sequence has one
            seq_slots = self.lora_manager.assign_slots([seq.lora_id for seq in sequences])  # [S] int32
            lora_slots = None if seq_slots is None else np.repeat(seq_slots, counts)  # [T] int32
        graphs = self.decode_graphs
        row_graphs = self.row_graphs
        needs_hidden = bool(prompt_rows or pool_rows)
        capture = None if not scheduler_output.spec_hidden_states else self.spec_hidden_layers
        spec_hidden = None
        if (
            graphs is not None
            and (capture is None or graphs.hidden_taps == capture)  # EAGLE: decode graphs holding its hidden states
            and (lora_slots is None or graphs.max_loras is not None)
            and uses_decode_graph(graphs, is_decode, len(sample_rows), num_seqs, needs_hidden)
        ):
            block_tables = pad_block_tables(table_lens, flat_tables)  # [S, max_blocks]
            extra = {} if graphs.max_loras is None else {"lora_slots": lora_slots}
            sample_logits = graphs.replay(
                input_ids, positions, slots, block_tables, ntk_tables, pending=pending, **extra
            )
            if capture is not None:
                spec_hidden = graphs.spec_hidden_of(counts)  # [S, width]: one token per sequence
            prompt_hidden = pooled = None
        elif (
            row_graphs is not None
            and (capture is None or row_graphs.hidden_taps == capture)  # EAGLE: graphs holding its hidden states
            and not is_decode
            and lora_slots is None
            and uses_row_graph(row_graphs, counts, seq_lens, len(sample_rows), needs_hidden, pending is not None)
        ):
            block_tables = pad_block_tables(table_lens, flat_tables)  # [S, max_blocks]
            seq_tables = None if ntk_tables is None else ntk_tables[ends - 1]  # [S] one table per sequence
            sample_logits = row_graphs.replay_rows(
                input_ids, counts, seq_lens, slots, block_tables, sample_rows, seq_tables, device_inputs=draft_inputs
            )  # [N, vocab]
            if capture is not None:
                spec_hidden = row_graphs.spec_hidden_of(counts)  # [T, width]
            prompt_hidden = pooled = None
        elif self.piecewise_graphs is not None and uses_piecewise_graph(
            self.piecewise_graphs,
            num_tokens,
            needs_hidden,
            lora_slots is not None,
            capture,
            bool(scheduler_output.num_spec_tokens),
            self.piecewise_takes_spec_steps,
        ):
            sample_logits, spec_hidden = self._forward_piecewise(
                input_ids,
                positions,
                slots,
                table_lens,
                flat_tables,
                np.concatenate(([0], ends)),
                seq_lens,
                int(counts.max()),
                sample_rows,
                ntk_tables,
                pending if draft_inputs is None else self._on_device(draft_inputs),
                keep_hidden=capture is not None,
            )
            prompt_hidden = pooled = None
        else:
            if lora_slots is not None:
                lora = build_lora_indices(lora_slots, self.device, self.lora_manager.overlap)
            sample_logits, prompt_hidden, pooled, spec_hidden = self._forward_eager(
                input_ids,
                positions,
                slots,
                table_lens,
                flat_tables,
                np.concatenate(([0], ends)),
                seq_lens,
                int(counts.max()),
                sample_rows,
                prompt_rows,
                ntk_tables,
                pending if draft_inputs is None else self._on_device(draft_inputs),
                [row for row, _ in pool_rows],
                lora,
                capture,
            )
        if pooled is not None:  # enqueued before the sampled ids' event: ready with them
            pooled = ([rid for _, rid in pool_rows], self._to_host(pooled))
        if scheduler_output.num_spec_tokens:
            assert previous is None or not any(map(_num_pending, sequences)), "drafts after a token in flight"
            step = self._verify(
                sequences, sample_logits, prompt_hidden, prompt_targets, prompt_owners, scheduler_output
            )
        else:
            step = self._sample(
                sequences, sample_logits, prompt_hidden, prompt_targets, prompt_owners, scheduler_output, previous
            )
        step.pooled = pooled
        step.spec_hidden_states = spec_hidden
        return step

    def _on_device(self, inputs: tuple[np.ndarray, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids left on the device (drafts: host token indices [D], ids [D]) in the form the eager
        and piecewise forwards write over their input ids (both on the device)."""
        return _to_device(inputs[0], self.device), inputs[1]

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy to the host (pinned on CUDA), complete once later work is."""
        if self.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def _forward_eager(
        self,
        input_ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        table_lens: np.ndarray,
        flat_tables: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        max_query_len: int,
        sample_rows: np.ndarray,
        prompt_rows: list[int],
        ntk_tables: np.ndarray | None = None,
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,
        pool_rows: list[int] | None = None,
        lora: LoRAIndices | None = None,
        spec_taps: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(sampling rows' logits, prompt-logprob rows' hidden states, ``pool_rows``' hidden states
        as float32, every token's hidden states for an EAGLE head when ``spec_taps`` is not None);
        each None when there are no such rows."""
        device = self.device
        metadata = self._metadata(slots, table_lens, flat_tables, query_start_loc, seq_lens, max_query_len, ntk_tables)
        input_ids_t = _to_device(np.array(input_ids, dtype=np.int64), device)  # [T]
        if pending is not None:  # tokens sampled by the step in flight, straight from the device
            input_ids_t.index_copy_(0, *pending)
        lora_kwargs = {} if lora is None else {"lora": lora}  # no adapter row: the call is the base model's
        spec_hidden = None
        if spec_taps:  # EAGLE-3: the residual streams entering the tapped layers
            hidden, spec_hidden = self.model.forward_with_taps(
                input_ids_t, _to_device(positions, device), self.kv_caches, metadata, spec_taps, **lora_kwargs
            )  # [T, hidden], [T, len(taps) * hidden]
        else:
            hidden = self.model(
                input_ids_t,  # [T] int64
                _to_device(positions, device),  # [T] int64
                self.kv_caches,
                metadata,
                **lora_kwargs,
            )  # [T, hidden]
            if spec_taps is not None:  # EAGLE: the final hidden states themselves
                spec_hidden = hidden
        sample_logits = self._sample_logits(hidden, sample_rows)
        prompt_hidden = None
        if prompt_rows:
            # Hidden states only: their logits are computed in slices by _sample, so a long prompt
            # asking for prompt_logprobs never holds [P, vocab] float32 (the planner counts a slice).
            prompt_hidden = hidden[_to_device(np.array(prompt_rows, dtype=np.int64), device)]  # [P, hidden]
        pooled = None
        if pool_rows:
            pooled = hidden[_to_device(np.array(pool_rows, dtype=np.int64), device)].float()  # [H, hidden]
        return sample_logits, prompt_hidden, pooled, spec_hidden

    def _metadata(
        self,
        slots: np.ndarray,  # int64 [T]
        table_lens: np.ndarray,  # int64 [S]
        flat_tables: np.ndarray,  # int64 [sum(table_lens)]
        query_start_loc: np.ndarray,  # int64 [S + 1]
        seq_lens: np.ndarray,  # int64 [S]
        max_query_len: int,
        ntk_tables: np.ndarray | None,  # int64 [T] or None
    ) -> AttentionMetadata:
        """The step's attention metadata on the device (eager and piecewise steps)."""
        device = self.device
        block_tables = pad_block_tables(table_lens, flat_tables)  # [S, max_blocks]
        return AttentionMetadata(
            slot_mapping=_to_device(slots, device),  # [T] int64
            block_tables=_to_device(block_tables, device),  # [S, max_blocks] int32
            seq_lens=_to_device(seq_lens, device),  # [S] int64
            query_start_loc=_to_device(query_start_loc, device),  # [S + 1] int64
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            ntk_tables=None if ntk_tables is None else _to_device(ntk_tables, device),  # [T] int64
        )

    def _sample_logits(self, hidden: torch.Tensor, sample_rows: np.ndarray) -> torch.Tensor | None:
        """float32 ``[R, vocab]`` of ``hidden``'s (``[T, hidden]``) rows ``sample_rows``; None when there are none."""
        if len(sample_rows) == hidden.shape[0]:  # every token is sampled (pure decode): no gather
            return self.model.compute_logits(hidden)  # [R, vocab]
        if len(sample_rows):
            return self.model.compute_logits(hidden[_to_device(sample_rows, self.device)])  # [R, vocab]
        return None

    def _forward_piecewise(
        self,
        input_ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        table_lens: np.ndarray,
        flat_tables: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        max_query_len: int,
        sample_rows: np.ndarray,
        ntk_tables: np.ndarray | None = None,
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,
        keep_hidden: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the sampling rows' logits, with ``keep_hidden`` every token's final hidden states for an
        EAGLE head, else None) of a step through the piecewise graphs (``uses_piecewise_graph``): the
        same step as ``_forward_eager`` with no prompt-logprob, pooled, EAGLE-3 nor LoRA rows."""
        assert self.piecewise_graphs is not None
        metadata = self._metadata(slots, table_lens, flat_tables, query_start_loc, seq_lens, max_query_len, ntk_tables)
        hidden = self.piecewise_graphs.run(input_ids, positions, metadata, ntk_tables, pending)  # [T, hidden]
        # a copy: the next replay rewrites the static output before the head has read it
        spec_hidden = hidden.clone() if keep_hidden else None  # [T, hidden]
        return self._sample_logits(hidden, sample_rows), spec_hidden

    def _verify(
        self,
        sequences: list,
        sample_logits: torch.Tensor,
        prompt_hidden: torch.Tensor | None,
        prompt_targets: list[int],
        prompt_owners: list[tuple[str, int]],
        scheduler_output: SchedulerOutput,
    ) -> LaunchedStep:
        """A step with draft tokens: one sampling row per draft plus one per sampling sequence,
        rejection sampling (``qserve.runner.rejection_sampler``), results on the host at once (the
        speculative step is synchronous). Prompt logprobs of prefilling sequences as ``_sample``."""
        step = self._sample(sequences, None, prompt_hidden, prompt_targets, prompt_owners)
        sampling_seqs = [seq for seq in sequences if seq.sample]
        params, prompts, outputs, drafts = [], [], [], []
        for seq in sampling_seqs:
            spec = list(seq.spec_token_ids)
            for j in range(len(spec) + 1):  # row j: the drafts before it count as outputs
                params.append(seq.sampling_params)
                prompts.append(seq.prompt_token_ids)
                outputs.append(seq.output_token_ids if j == 0 else [*seq.output_token_ids, *spec[:j]])
            drafts.append(spec)
        first_row = np.cumsum([0] + [len(d) + 1 for d in drafts])  # [R + 1]
        token_bitmask = None
        if scheduler_output.grammar_request_ids:  # constrained sequences never get drafts: one row each
            row_of = {seq.request_id: int(first_row[i]) for i, seq in enumerate(sampling_seqs)}
            token_bitmask = (
                [row_of[r] for r in scheduler_output.grammar_request_ids],
                scheduler_output.grammar_bitmask,
            )
        metadata = build_sampling_metadata(
            params,
            prompts,
            outputs,
            list(self.config.eos_token_ids),
            sample_logits.shape[-1],
            "cpu",
            token_bitmask,
        ).to(self.device)
        device_drafts = scheduler_output.spec_device_drafts
        if device_drafts is None:
            flat_drafts = [t for d in drafts for t in (*d, -1)]
            draft_ids = _to_device(np.array(flat_drafts, dtype=np.int64), self.device)  # [N]
        else:  # drafts are placeholders here: their ids from the device
            draft_ids = self._device_draft_ids(sampling_seqs, drafts, first_row, device_drafts, metadata)  # [N]
        targets, accepted = verify_rows(self.sampler, sample_logits, metadata, draft_ids)  # [N], [N]
        if device_drafts is None:
            emitted = accepted_tokens(drafts, targets.tolist(), accepted.tolist())  # the step's one sync
        else:
            num_rows = targets.shape[0]
            host = torch.cat([targets, accepted.to(torch.int64), draft_ids]).tolist()  # the cycle's one sync
            ids = host[2 * num_rows :]
            drafts = [ids[int(first_row[i]) : int(first_row[i]) + len(d)] for i, d in enumerate(drafts)]
            emitted = accepted_tokens(drafts, host[:num_rows], host[num_rows : 2 * num_rows])
        step.host_sampled = torch.tensor([tokens[-1] for tokens in emitted], dtype=torch.int64)  # [R]
        step.sampled = step.host_sampled.to(self.device)
        for seq, tokens in zip(sampling_seqs, emitted):
            if seq.spec_token_ids:
                step.spec_token_ids[seq.request_id] = tokens
        if metadata.max_num_logprobs is not None:
            self._verify_logprobs(step, sampling_seqs, emitted, first_row, sample_logits)
        return step

    def _device_draft_ids(
        self,
        sampling_seqs: list,
        drafts: list[list[int]],  # placeholders: their counts
        first_row: np.ndarray,  # [R + 1]
        device_drafts,  # noqa: ANN001 - qserve.spec_decode.proposer.DeviceDrafts
        metadata,  # noqa: ANN001 - SamplingMetadata
    ) -> torch.Tensor:
        """int64 ``[N]``: each verify row's draft from the device (-1 for a sequence's last row), and the
        drafts written into the rows' output ids where penalties read them (the metadata was built
        with placeholders)."""
        table = device_drafts.drafts  # [rows, width]
        width, sentinel = table.shape[1], table.numel()
        source = np.full(int(first_row[-1]), sentinel, dtype=np.int64)  # [N]
        fill_rows, fill_cols, fill_source = [], [], []
        for i, (seq, draft) in enumerate(zip(sampling_seqs, drafts)):
            count = len(draft)
            if not count:
                continue
            base = device_drafts.rows[seq.request_id] * width
            first = int(first_row[i])
            source[first : first + count] = np.arange(base, base + count)
            known = len(seq.output_token_ids)
            for j in range(1, count + 1):  # row j's outputs end with drafts 0..j-1
                fill_rows += [first + j] * j
                fill_cols += range(known, known + j)
                fill_source += range(base, base + j)
        flat = torch.cat([table.reshape(-1), table.new_full((1,), -1)])  # [rows * width + 1]
        draft_ids = flat.index_select(0, _to_device(source, self.device))  # [N]
        if metadata.output_token_ids is not None and fill_rows:
            where = _to_device(np.array([fill_rows, fill_cols, fill_source], dtype=np.int64), self.device)  # [3, F]
            metadata.output_token_ids.index_put_((where[0], where[1]), flat.index_select(0, where[2]))
        return draft_ids

    def _verify_logprobs(
        self,
        step: LaunchedStep,
        sampling_seqs: list,
        emitted: list[list[int]],
        first_row: np.ndarray,
        sample_logits: torch.Tensor,
    ) -> None:
        """Raw logprobs (as ``Sampler``'s) of every emitted token of the sequences asking for them."""
        rows, chosen, owners = [], [], []
        for i, (seq, tokens) in enumerate(zip(sampling_seqs, emitted)):
            k = seq.sampling_params.logprobs
            if k is not None:
                rows += range(int(first_row[i]), int(first_row[i]) + len(tokens))
                chosen += tokens
                owners += [(seq, k)] * len(tokens)
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=sample_logits.device)  # [L]
        logits = mask_padded_vocab(sample_logits[index].float(), self.valid_vocab_size, in_place=True)  # [L, V]
        max_k = max(k for _, k in owners)
        if self.valid_vocab_size is not None:
            max_k = min(max_k, self.valid_vocab_size)
        entries = gather_logprobs(
            torch.log_softmax(logits, dim=-1), torch.tensor(chosen, dtype=torch.int64, device=logits.device), max_k
        )
        for (seq, k), entry in zip(owners, entries):
            entry = TokenLogprobs(entry.token_ids[: k + 1], entry.logprobs[: k + 1], entry.ranks[: k + 1])
            if seq.spec_token_ids:
                step.spec_logprobs.setdefault(seq.request_id, []).append(entry)
            else:
                step.logprobs[seq.request_id] = entry

    def _sample(
        self,
        sequences: list,
        sample_logits: torch.Tensor | None,
        prompt_hidden: torch.Tensor | None,
        prompt_targets: list[int],
        prompt_owners: list[tuple[str, int]],
        scheduler_output: SchedulerOutput | None = None,
        previous: LaunchedStep | None = None,
    ) -> LaunchedStep:
        sampling_seqs = [seq for seq in sequences if seq.sample]
        step = LaunchedStep([seq.request_id for seq in sampling_seqs])
        logprobs = step.logprobs
        token_bitmask = None
        if scheduler_output is not None and scheduler_output.grammar_request_ids:
            row_of = {seq.request_id: row for row, seq in enumerate(sampling_seqs)}
            token_bitmask = (
                [row_of[rid] for rid in scheduler_output.grammar_request_ids],
                scheduler_output.grammar_bitmask,
            )
        if sample_logits is not None:
            num_pending = [_num_pending(seq) for seq in sampling_seqs]
            outputs = [seq.output_token_ids for seq in sampling_seqs]
            sampling_metadata = build_sampling_metadata(
                [seq.sampling_params for seq in sampling_seqs],
                [seq.prompt_token_ids for seq in sampling_seqs],
                outputs,
                list(self.config.eos_token_ids),
                sample_logits.shape[-1],
                "cpu",  # built on the host, then copied without waiting for the device
                token_bitmask,
                num_pending_tokens=num_pending,
            ).to(self.device)
            if sampling_metadata.output_token_ids is not None and any(num_pending):
                # penalties count the token still in flight too: its id, straight from the device
                rows, cols = pending_output_slots(outputs, num_pending)
                assert previous is not None and previous.sampled is not None
                source = [previous.row_of(sampling_seqs[r].request_id) for r in rows]
                where = _to_device(np.array([rows, cols, source], dtype=np.int64), self.device)  # [3, P], one copy
                sampling_metadata.output_token_ids.index_put_(
                    (where[0], where[1]), previous.sampled.index_select(0, where[2])
                )
            tokens, token_logprobs = self.sampler(sample_logits, sampling_metadata, on_device=True)  # [R] int64
            step.sampled = tokens
            if self.device.type == "cuda":
                step.host_sampled = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)  # [R]
                step.host_sampled.copy_(tokens, non_blocking=True)
                step.ready = torch.cuda.Event()
                step.ready.record(torch.cuda.current_stream(self.device))
            else:
                step.host_sampled = tokens
            if sampling_metadata.max_num_logprobs is not None:
                for seq, token_lp in zip(sampling_seqs, token_logprobs):
                    if token_lp is not None:
                        logprobs[seq.request_id] = token_lp

        prompt_logprobs = step.prompt_logprobs
        if prompt_hidden is not None:
            targets = torch.tensor(prompt_targets, dtype=torch.int64, device=self.device)  # [P]
            max_k = max(k for _, k in prompt_owners)
            entries = []
            for start in range(0, len(prompt_targets), PROMPT_LOGPROBS_CHUNK_ROWS):
                end = start + PROMPT_LOGPROBS_CHUNK_ROWS
                logits = self.model.compute_logits(prompt_hidden[start:end])  # [<=chunk, vocab] float32
                entries += compute_prompt_logprobs(logits, targets[start:end], max_k, self.valid_vocab_size)
                del logits
            for (request_id, k), entry in zip(prompt_owners, entries):
                if k < max_k:  # trim to what this request asked for: the actual token plus its top-k
                    entry = TokenLogprobs(entry.token_ids[: k + 1], entry.logprobs[: k + 1], entry.ranks[: k + 1])
                prompt_logprobs.setdefault(request_id, []).append(entry)
        return step
