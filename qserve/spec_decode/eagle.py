"""The EAGLE / EAGLE-3 proposer (vLLM's ``method: "eagle"`` / ``"eagle3"``): a head reads the target's
hidden states and drafts k tokens autoregressively, its KV cache indexed by the target's blocks.

Knows: which positions of each sequence the head's KV covers, how a step's captured target hidden
states become the head's inputs, and how to run the head (``EagleHead``) over a batch with
``AttentionMetadata`` it builds. Must not know: the scheduler's queues, sampling of the target,
stops.

Positions: the head at position p reads the token at p + 1 and the target's feature at p, and its
output predicts the token at p + 2 (vLLM's shift by one). After a step of the target, the head
"catches up" (``observe``): one batched forward over every sequence's positions the target just
computed and kept (a prefill chunk, a plain decode's one, a verify step's last known token plus
its accepted drafts), whose next tokens are now all known. The head's valid KV then ends at the
sequence's last known token minus one, and the output of that position gives the first draft.
``propose`` takes it from there: k - 1 more forwards of one row per sequence, each reading the
previous draft and the head's own output feature; those positions' KV is rewritten by the next
catch-up (they held drafts, not target features).

Steps whose hidden states were not captured (a busy engine decoding without speculation, with its
CUDA graphs; a swapped-out or preempted sequence; a prompt prefix from the prefix cache) leave positions the head never
saw: at the next proposal it catches up over them with a zero feature (the tokens alone), so its
attention has no holes, and the sequence skips that one proposal: the step that follows is a
captured plain decode, after which the head drafts from a real feature of the newest position.
Its attention over the filled positions is poorer than with the target's features; drafts may be
worse for it, never wrong (the rejection sampler decides).

KV: the head's own caches indexed by the target's block ids (``shadow_kv.ShadowKV``): position p's
KV sits at the target's slot of p, so the head takes no page of the pool; the positions it drafts
from past the target's table use scratch blocks for the one proposal. Prefix caching: a sequence
served from the prefix cache starts with a gap over the cached positions (the head KV of those
blocks may have been written for another next token, from zero features, or never: it is not
trusted), but its catch-up stores no KV in a block another sequence holds (``ShadowKV.shared``: slot
-1): the newcomer attends over what the other holder's head wrote there, and the other holder's
head KV is never overwritten (from zero features, or for another next token at a block's last
position). Drafts may be poorer for it, never wrong.

Drafts are the head's argmax (a point mass q: the rejection rule p(d) keeps the target's
distribution exactly).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from qserve.request import Request
from qserve.runner.attn_metadata import AttentionMetadata
from qserve.runner.model_runner import pad_block_tables
from qserve.sampling_params import SamplingParams
from qserve.spec_decode.eagle_graphs import HeadCatchUpGraphs, HeadDraftGraphs
from qserve.spec_decode.eagle_head import EagleHead
from qserve.spec_decode.proposer import DeviceDrafts, ProposalInput, Proposer
from qserve.spec_decode.shadow_kv import ShadowKV

_MIRROR_PARAMS = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(frozen=True, slots=True)
class ObservedRows:
    """One sequence's share of a step whose target hidden states were captured: the positions
    ``[start_position, start_position + num_rows)`` were computed and kept, their states are rows
    ``[row_offset, row_offset + num_rows)`` of the step's tensor; the token ids are the sequence's
    own (shared lists, read-only), known past the last of those positions."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    start_position: int
    num_rows: int
    row_offset: int


@dataclass(eq=False, slots=True)
class _Work:
    """Positions ``[start, end)`` of one sequence for one head forward, with their inputs."""

    mirror: Request
    start: int
    end: int
    input_ids: list[int]  # the token after each position
    features: torch.Tensor  # [end - start, H]


def _token(prompt: Sequence[int], output: Sequence[int], position: int) -> int:
    return prompt[position] if position < len(prompt) else output[position - len(prompt)]


class EagleProposer(Proposer):
    def __init__(
        self,
        head: EagleHead,
        shadow: ShadowKV,
        device: torch.device,
        max_tokens_per_forward: int,
    ) -> None:
        self.head = head
        self.shadow = shadow
        self.device = device
        self.max_tokens_per_forward = max(1, max_tokens_per_forward)
        # num_computed_tokens: positions whose head KV holds target features (or a zero fill)
        self._mirrors: dict[str, Request] = {}
        # request id -> (logits input [H], next feature [H]) of position num_computed_tokens - 1
        self._last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hidden_size = head.config.model.hidden_size
        # Captured drafting forwards (set by the engine unless QSERVE_EAGLE_HEAD_GRAPHS=0; None: eager)
        self.graphs: HeadDraftGraphs | None = None
        # Captured catch-up forwards (set by the engine unless QSERVE_EAGLE_CATCH_UP_GRAPHS=0; None: eager)
        self.catch_up_graphs: HeadCatchUpGraphs | None = None

    # ------------------------------------------------------------------------------------------
    # Catching up on the target's steps
    # ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, rows: Sequence[ObservedRows], target_hidden: torch.Tensor) -> None:
        """A step's captured hidden states ``[num_tokens, width]``: the head catches up on every
        listed sequence (positions it missed before them get a zero feature)."""
        if not rows:
            return
        index = torch.as_tensor(
            np.concatenate([np.arange(r.row_offset, r.row_offset + r.num_rows) for r in rows]), device=self.device
        )  # [N]
        combined = self.head.combine(target_hidden.index_select(0, index))  # [N, H]
        work, offset = [], 0
        for r in rows:
            mirror = self._mirror(r.request_id, r.prompt_token_ids)
            end = r.start_position + r.num_rows
            start = mirror.num_computed_tokens
            features = combined[offset : offset + r.num_rows]
            offset += r.num_rows
            if start >= end:
                continue
            if start > r.start_position:  # the head has these already (identical inputs)
                features = features[start - r.start_position :]
            elif start < r.start_position:  # a gap: positions whose features were never captured
                gap = features.new_zeros(r.start_position - start, self._hidden_size)
                features = torch.cat([gap, features])
            ids = [_token(r.prompt_token_ids, r.output_token_ids, p + 1) for p in range(start, end)]
            work.append(_Work(mirror, start, end, ids, features))
        self._catch_up(work)

    def _catch_up(self, work: list[_Work]) -> None:
        """Run the head over each entry's positions (in chunks of at most ``max_tokens_per_forward``
        rows), advancing its mirror and keeping the last position's outputs. Every position was
        computed by the target, so its slot is in the target's table (an entry whose table does not
        reach that far, which should not happen, is dropped: its positions become a gap)."""
        pending = [item for item in work if self.shadow.covers(item.mirror.request_id, item.end)]
        pending = self._catch_up_in_graphs(pending)
        while pending:
            batch, budget, rest = [], self.max_tokens_per_forward, []
            for item in pending:
                if budget <= 0:
                    rest.append(item)
                    continue
                take = min(budget, item.end - item.start)
                budget -= take
                batch.append((item, take))
            chunk = [(self.shadow.table(item.mirror.request_id), item.start, take) for item, take in batch]
            ids = [t for item, take in batch for t in item.input_ids[:take]]
            features = torch.cat([item.features[:take] for item, take in batch])  # [T, H]
            logits_in, feature = self._forward(chunk, torch.tensor(ids, dtype=torch.int64), features)
            # each sequence's last row, gathered (a kept view would hold the whole chunk's tensor)
            ends = torch.as_tensor(np.cumsum([take for _, take in batch]) - 1, device=self.device)  # [S]
            last_in, last_feature = logits_in.index_select(0, ends), feature.index_select(0, ends)  # [S, H]
            for row, (item, take) in enumerate(batch):
                item.mirror.num_computed_tokens = item.start + take
                self._last[item.mirror.request_id] = (last_in[row], last_feature[row])
                if take < item.end - item.start:
                    item.start += take
                    item.input_ids = item.input_ids[take:]
                    item.features = item.features[take:]
                    rest.append(item)
            pending = rest

    def _catch_up_in_graphs(self, work: list[_Work]) -> list[_Work]:
        """Catch the entries that fit the catch-up graphs (``HeadCatchUpGraphs``: at most k + 1
        positions, ending at or past k + 1, a table within its width) up in one replay, as many as its
        largest bucket holds; return the rest (all of it without graphs) for the eager forwards."""
        graphs = self.catch_up_graphs
        if graphs is None:
            return work
        tables = {id(item): self.shadow.table(item.mirror.request_id) for item in work}
        fit = [
            item
            for item in work
            if graphs.fits(item.end - item.start, item.end) and len(tables[id(item)]) <= graphs.max_blocks
        ][: graphs.buckets[-1]]
        if not fit:
            return work
        chunk = [(tables[id(item)], item.start, item.end - item.start) for item in fit]
        _, slots, table_lens, flat, seq_lens, counts = self._layout(chunk)
        last_in, last_feature = graphs.catch_up(
            [t for item in fit for t in item.input_ids],
            torch.cat([item.features for item in fit]),  # [T, H]
            counts,
            seq_lens,
            slots,
            pad_block_tables(table_lens, flat),
        )  # [S, H], [S, H]
        for row, item in enumerate(fit):
            item.mirror.num_computed_tokens = item.end
            self._last[item.mirror.request_id] = (last_in[row], last_feature[row])
        taken = {id(item) for item in fit}
        return [item for item in work if id(item) not in taken]

    def _mirror(self, request_id: str, prompt: Sequence[int]) -> Request:
        mirror = self._mirrors.get(request_id)
        if mirror is None:
            mirror = self._mirrors[request_id] = Request(request_id, list(prompt), _MIRROR_PARAMS)
        return mirror

    # ------------------------------------------------------------------------------------------
    # Proposing
    # ------------------------------------------------------------------------------------------

    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        counts, device = self._propose(batch)
        if device is None:
            return [[] for _ in batch]
        table = device.drafts.tolist()  # [rows, k_max]: the proposal's one sync with the host
        return [table[device.rows[item.request_id]][:count] if count else [] for item, count in zip(batch, counts)]

    def propose_on_device(self, batch: Sequence[ProposalInput]) -> tuple[list[int], DeviceDrafts | None]:
        """The drafts left on the device (no sync: the engine's default; QSERVE_EAGLE_DEVICE_DRAFTS=0 takes ``propose``): the
        verify step reads them there, after the drafting forwards in stream order."""
        return self._propose(batch)

    @torch.inference_mode()
    def _propose(self, batch: Sequence[ProposalInput]) -> tuple[list[int], DeviceDrafts | None]:
        """(drafts per input: its ``max_num_tokens`` if it drafts, else 0; the drafts on the device)."""
        # Positions the head never saw (steps without captured hidden states): it catches up on
        # their tokens alone, and the sequence gets no drafts this time: its next step (a plain
        # decode, whose states are captured while speculation is on) gives the head the real
        # feature of the newest position, from which the next proposal drafts.
        gaps, behind = [], set()
        for item in batch:
            last = len(item.prompt_token_ids) + len(item.output_token_ids) - 1  # the last known token
            if item.max_num_tokens <= 0 or last < 1:
                continue
            mirror = self._mirror(item.request_id, item.prompt_token_ids)
            if mirror.num_computed_tokens < last:
                start = mirror.num_computed_tokens
                ids = [_token(item.prompt_token_ids, item.output_token_ids, p + 1) for p in range(start, last)]
                zeros = torch.zeros(last - start, self._hidden_size, dtype=self._dtype, device=self.device)
                gaps.append(_Work(mirror, start, last, ids, zeros))
                behind.add(item.request_id)
        self._catch_up(gaps)
        # Sequences ready to draft: caught up to their last known token, with blocks for the KV of
        # the positions drafted from (the last known token onwards; the first draft needs none: it
        # comes from the last caught-up position). Those past the target's table are scratch blocks.
        ready, tables = [], {}
        for i, item in enumerate(batch):
            mirror = self._mirrors.get(item.request_id)
            last = len(item.prompt_token_ids) + len(item.output_token_ids) - 1
            if (
                item.max_num_tokens <= 0
                or item.request_id in behind
                or mirror is None
                or mirror.num_computed_tokens != last
                or item.request_id not in self._last
            ):
                continue
            table = self.shadow.draft_table(item.request_id, last + item.max_num_tokens - 1)
            if table is None:
                continue
            tables[item.request_id] = table
            ready.append(i)
        counts = [0] * len(batch)
        if not ready:
            return counts, None
        try:
            table = self._draft(batch, ready, tables)  # [R, k_max]
        finally:
            self.shadow.return_scratch()  # stream order: a later proposal's use of them comes after
        for i in ready:
            counts[i] = batch[i].max_num_tokens
        return counts, DeviceDrafts(table, {batch[i].request_id: row for row, i in enumerate(ready)})

    def _draft(
        self,
        batch: Sequence[ProposalInput],
        ready: list[int],
        tables: dict[str, list[int]],
    ) -> torch.Tensor:
        """int64 ``[R, k_max]`` on the device: row r holds the drafts of batch entry ``ready[r]`` in its
        first ``max_num_tokens`` columns (-1 past them)."""
        logits_in = torch.stack([self._last[batch[i].request_id][0] for i in ready])  # [R, H]
        feature = torch.stack([self._last[batch[i].request_id][1] for i in ready])  # [R, H]
        tokens = self.head.draft_tokens(logits_in)  # [R] int64 on the device: every first draft
        table = self._draft_in_graphs(batch, ready, tables, tokens, feature)
        if table is not None:
            return table
        columns = [tokens]
        drafting = list(ready)  # the batch indices still drafting, in row order of tokens / feature
        for j in range(1, max(batch[i].max_num_tokens for i in ready)):
            keep = [a for a, i in enumerate(drafting) if batch[i].max_num_tokens > j]
            if len(keep) < len(drafting):
                rows = self._index(keep)  # [A]
                tokens, feature = tokens.index_select(0, rows), feature.index_select(0, rows)
                drafting = [drafting[a] for a in keep]
            # draft j reads draft j - 1 at the position after the last known token, plus j - 1
            ids = [batch[i].request_id for i in drafting]
            chunk = [(tables[r], self._mirrors[r].num_computed_tokens + j - 1, 1) for r in ids]
            logits_in, feature = self._forward(chunk, tokens, feature)
            tokens = self.head.draft_tokens(logits_in)  # [A]
            column = torch.full((len(batch),), -1, dtype=torch.int64, device=self.device)  # [B]
            column[self._index(drafting)] = tokens
            columns.append(column)
        ready_rows = self._index(ready)  # [R]
        first = torch.full((len(batch),), -1, dtype=torch.int64, device=self.device)  # [B]
        first[ready_rows] = columns[0]
        columns[0] = first
        return torch.stack(columns, dim=1).index_select(0, ready_rows)  # [R, k_max]

    def _index(self, values: list[int]) -> torch.Tensor:
        """int64 ``[len(values)]`` on the device without waiting for it (pinned, asynchronous on CUDA):
        with drafts left on the device the proposal must not sync."""
        host = torch.tensor(values, dtype=torch.int64)
        return host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    def _draft_in_graphs(
        self,
        batch: Sequence[ProposalInput],
        ready: list[int],
        tables: dict[str, list[int]],
        first: torch.Tensor,  # int64 [R]: every ready row's first draft
        feature: torch.Tensor,  # [R, H]: the feature it came with
    ) -> torch.Tensor | None:
        """Drafts 2..k of the ``ready`` entries through the captured drafting forwards
        (``HeadDraftGraphs``), if there are graphs and the batch fits them: int64 ``[R, k_max]``, each
        row's drafts in its first ``max_num_tokens`` columns; None otherwise (nothing done). Every row
        keeps its place through all k - 1 forwards: a row that needs fewer drafts repeats its last
        drafting position with slot -1 (no KV stored); its extra drafts are ignored."""
        graphs = self.graphs
        counts = np.array([batch[i].max_num_tokens for i in ready], dtype=np.int64)  # [R]
        steps = int(counts.max()) - 1
        ids = [batch[i].request_id for i in ready]
        row_tables = [tables[r] for r in ids]
        table_lens = np.array([len(t) for t in row_tables], dtype=np.int64)  # [R]
        if graphs is None or steps < 1 or not graphs.fits(len(ready), steps, int(table_lens.max())):
            return None
        bases = np.array([self._mirrors[r].num_computed_tokens for r in ids], dtype=np.int64)  # [R]
        step = np.arange(1, steps + 1, dtype=np.int64)[:, None]  # [steps, 1]
        # draft j reads draft j - 1 at position base + j - 1; rows past their count repeat their last
        positions = bases[None, :] + np.minimum(step, counts[None, :] - 1) - 1  # [steps, R]
        flat = np.array([b for t in row_tables for b in t], dtype=np.int64)  # [sum(lens)]
        slots = self._slots(flat, (np.cumsum(table_lens) - table_lens)[None, :], positions)  # [steps, R]
        slots = np.where(step <= counts[None, :] - 1, slots, -1)
        block_tables = pad_block_tables(table_lens, flat)  # [R, width] int32
        later = graphs.draft(first, feature, positions, slots, block_tables)  # [steps, R]
        return torch.cat([first[None, :], later]).T.contiguous()  # [R, k_max]

    # ------------------------------------------------------------------------------------------
    # One forward of the head
    # ------------------------------------------------------------------------------------------

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.layers[0].post_attention_layernorm.weight.dtype

    def _forward(
        self,
        chunk: list[tuple[list[int], int, int]],  # (block table, first position, number of positions)
        input_ids: torch.Tensor,  # int64 [T] (host or device)
        features: torch.Tensor,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the positions of ``chunk`` (each sequence's KV before them is in its
        blocks of the shadow cache): (logits inputs ``[T, H]``, next features ``[T, H]``)."""
        positions, slots, table_lens, flat, seq_lens, counts = self._layout(chunk)
        ends = np.cumsum(counts)  # [S]
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),  # [T] int64
            block_tables=torch.from_numpy(pad_block_tables(table_lens, flat)).to(device),  # [S, max_blocks] int32
            seq_lens=torch.from_numpy(seq_lens).to(device),  # [S] int64
            query_start_loc=torch.from_numpy(np.concatenate(([0], ends))).to(device),  # [S + 1] int64
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return self.head(
            input_ids.to(device),
            torch.from_numpy(positions).to(device),
            features.to(self._dtype),
            self.shadow.kv_caches,
            metadata,
        )

    def _layout(
        self, chunk: list[tuple[list[int], int, int]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where ``chunk``'s positions (block table, first position, count per sequence) go: positions
        and slots ``[T]``, table lengths ``[S]``, the tables concatenated, sequence ends and counts ``[S]``."""
        starts = np.array([start for _, start, _ in chunk], dtype=np.int64)  # [S]
        counts = np.array([count for _, _, count in chunk], dtype=np.int64)  # [S]
        tables = [table for table, _, _ in chunk]
        table_lens = np.array([len(t) for t in tables], dtype=np.int64)  # [S]
        flat = np.array([b for t in tables for b in t], dtype=np.int64)  # [sum(lens)]
        ends = np.cumsum(counts)  # [S]
        positions = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - counts - starts, counts)  # [T]
        slots = self._slots(flat, np.repeat(np.cumsum(table_lens) - table_lens, counts), positions)  # [T]
        return positions, slots, table_lens, flat, starts + counts, counts

    def _slots(self, flat: np.ndarray, table_start: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The shadow-cache slot of each position (``table_start``: where its sequence's table begins
        in the concatenated tables ``flat``; any shape that broadcasts with ``positions``), -1 in a
        block another sequence holds: its head wrote that KV and reads it."""
        block_size = self.shadow.block_size
        blocks = flat[table_start + positions // block_size]
        return np.where(self.shadow.shared(blocks), -1, blocks * block_size + positions % block_size)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._mirrors.pop(request_id, None)  # the head holds no pages: the target's go back
            self._last.pop(request_id, None)
