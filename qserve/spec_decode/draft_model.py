"""The draft-model proposer (vLLM's ``method: "draft_model"``): a small checkpoint of the same
tokenizer proposes k tokens greedily, its KV cache indexed by the target's block ids.

Knows: how to keep a draft-side copy of each sequence (``Request`` mirrors: the target's tokens,
then the drafts of the last proposal), how far the draft's KV is valid (the prefix shared with
the target's tokens now: drafts the target rejected are recomputed), and how to drive the draft
through a ``ModelRunner`` (a catch-up chunk with the sequence's new tokens, then one row per
further draft). Must not know: the target's scheduler queues, sampling of the target, stops.

KV: the draft's own caches indexed by the target's block ids (``shadow_kv.ShadowKV``, as an EAGLE
head's): its KV of position p sits at the target's slot of p, so it takes no page of the pool. The
positions past the target's table (the last known token, when the target has no slot for it yet,
and the drafts: the scheduler gives the target their slots after the proposal) use scratch blocks.
The sequence keeps them until its next proposal, which first moves the rows still valid (the
accepted drafts' KV) into the target's blocks that now hold those positions, so a verify step that
kept every draft needs a catch-up of 2 tokens, as before (a position whose block the target does
not hold is recomputed). Those rows are the KV of tokens the target kept, a function of the tokens
before them only, so writing them is harmless even in a block shared through the prefix cache.
A draft of any depth and KV width fits.

Drafts are the draft model's argmax tokens (after the request's penalties, logit_bias and
min_tokens): a point mass q, so the rejection sampler's rule
(accept with probability p(d)) keeps the target distribution exactly, as for n-gram drafts.
A sequence gets drafts only when the draft caught up with it in this call and scratch blocks were
left for its positions past the target's table; otherwise none, and it decodes plainly. The
catch-up forward computes at most ``max_catch_up`` tokens in all (the engine's step budget, which
its memory plan measured): after steps without proposals (the batch above
``disable_by_batch_size``) every sequence is far behind, and one forward over all of them would be
a prefill of any size; sequences past the budget catch up in the next calls, oldest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from qserve.request import Request
from qserve.runner.model_runner import ModelRunner
from qserve.sampling_params import SamplingParams
from qserve.scheduler.output import ScheduledSequence, SchedulerOutput
from qserve.spec_decode.proposer import ProposalInput, Proposer
from qserve.spec_decode.shadow_kv import ShadowKV

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def draft_params(params: SamplingParams | None) -> SamplingParams:
    """The draft's sampling of a request: greedy over the request's own logit processing
    (penalties, logit_bias, min_tokens), so its argmax is the likeliest token of the target's p."""
    if params is None:
        return GREEDY
    return params.clone(
        n=1, temperature=0.0, seed=None, logprobs=None, prompt_logprobs=None, structured_outputs=None, max_tokens=None
    )


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, shadow: ShadowKV, max_catch_up: int) -> None:
        self.runner = runner  # its KV caches are shadow.kv_caches
        self.shadow = shadow
        self.max_catch_up = max_catch_up
        self._mirrors: dict[str, Request] = {}
        self._synced: dict[str, int] = {}  # outputs of the target known at the last proposal
        # request id -> [(index in its block table, scratch block)] of its last proposal
        self._held: dict[str, list[tuple[int, int]]] = {}
        self._tables: dict[str, list[int]] = {}  # the block tables of the proposal under way

    def _sync(self, item: ProposalInput) -> Request:
        """The draft's copy of the sequence, its valid KV cut to the prefix shared with the target."""
        mirror = self._mirrors.get(item.request_id)
        if mirror is None:
            mirror = self._mirrors[item.request_id] = Request(
                item.request_id, list(item.prompt_token_ids), draft_params(item.sampling_params)
            )
            self._synced[item.request_id] = 0
        target, mine = item.output_token_ids, mirror.output_token_ids
        common = min(self._synced[item.request_id], len(target))
        while common < len(mine) and common < len(target) and mine[common] == target[common]:
            common += 1  # the drafts the target accepted
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, mirror.num_prompt_tokens + common)
        mirror.output_token_ids = list(target)
        self._synced[item.request_id] = len(target)
        self._settle(mirror)
        return mirror

    def _settle(self, mirror: Request) -> None:
        """Move the valid rows of the sequence's scratch blocks into the target's blocks now at those
        table indices, cut its valid KV where the target holds no block, give the scratch back."""
        held = self._held.pop(mirror.request_id, None)
        if not held:
            return
        table, size = self.shadow.target.block_table(mirror.request_id), self.shadow.block_size
        for index, block in held:
            if index >= len(table):  # the target has no block there: recompute from it
                mirror.num_computed_tokens = min(mirror.num_computed_tokens, index * size)
                continue
            self.shadow.move_rows(block, table[index], min(mirror.num_computed_tokens - index * size, size))
        self.shadow.release([block for _, block in held])

    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        try:
            return self._propose(batch)
        finally:
            self._tables = {}

    def _propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {}
        first: list[ScheduledSequence] = []
        wants: dict[str, int] = {}
        budget = self.max_catch_up  # tokens of the catch-up forward, all sequences together
        for item in batch:
            mirror = self._sync(item)
            behind = mirror.num_tokens - mirror.num_computed_tokens  # new tokens, the last one included
            catch_up = min(behind, budget)
            if catch_up == 0:  # the budget is spent: no drafts for it this step
                continue
            k = item.max_num_tokens if catch_up == behind else 0
            end = mirror.num_computed_tokens + catch_up + max(k - 1, 0)  # positions whose KV it writes
            num_target = len(self.shadow.target.block_table(item.request_id))
            table = self.shadow.draft_table(item.request_id, end)
            if table is None:  # the scratch blocks are spent
                continue
            self._tables[item.request_id] = table
            if len(table) > num_target:  # held until its next proposal (_settle)
                self._held[item.request_id] = list(enumerate(table))[num_target:]
            budget -= catch_up
            first.append(self._scheduled(mirror, catch_up, sample=k > 0))
            if k > 0:
                wants[item.request_id] = k
                drafts[item.request_id] = []
        sequences = first
        while sequences:
            output = self.runner.execute(SchedulerOutput(sequences, sum(s.num_new_tokens for s in sequences)))
            following = []
            for seq in sequences:
                mirror = self._mirrors[seq.request_id]
                mirror.num_computed_tokens += seq.num_new_tokens
                if not seq.sample:
                    continue
                token = output.sampled_token_ids[seq.request_id]
                mirror.output_token_ids.append(token)
                drafts[seq.request_id].append(token)
                if len(drafts[seq.request_id]) < wants[seq.request_id]:
                    following.append(self._scheduled(mirror, 1, sample=True))
            sequences = following
        return [drafts.get(item.request_id, []) for item in batch]

    def _scheduled(self, mirror: Request, num_new: int, sample: bool) -> ScheduledSequence:
        return ScheduledSequence(
            request_id=mirror.request_id,
            start_position=mirror.num_computed_tokens,
            num_new_tokens=num_new,
            block_ids=self._tables[mirror.request_id],
            prompt_token_ids=mirror.prompt_token_ids,
            output_token_ids=mirror.output_token_ids,
            sampling_params=mirror.sampling_params,
            sample=sample,
        )

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._mirrors.pop(request_id, None)  # the draft holds no pages: the target's go back
            self._synced.pop(request_id, None)
            held = self._held.pop(request_id, None)
            if held:
                self.shadow.release([block for _, block in held])
