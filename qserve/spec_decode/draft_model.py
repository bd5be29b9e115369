"""The draft-model proposer (vLLM's ``method: "draft_model"``): a small checkpoint of the same
tokenizer proposes k tokens greedily, its KV cache in the target's own page pool.

Knows: how to keep a draft-side copy of each sequence (``Request`` mirrors: the target's tokens,
then the drafts of the last proposal), how far the draft's KV is valid (the prefix shared with
the target's tokens now: drafts the target rejected are recomputed), and how to drive the draft
through a ``ModelRunner`` (a catch-up chunk with the sequence's new tokens, then one row per
further draft). Must not know: the target's scheduler queues, sampling of the target, stops.

Pages: the draft's blocks come from the target's ``BlockPool`` under the owner ``<target>:draft``
(no second memory budget), and its per-layer KV caches are views of the target's: draft layer l
lives in target layer l's K / V tensors (``alias_kv_caches``), in the blocks the draft owns, so a
block holds either model's KV, never both. That needs a draft with no more layers than the target
and a block per layer no larger than the target's (a 0.5B draft of a 7B target fits).

Drafts are the draft model's argmax tokens (after the request's penalties, logit_bias and
min_tokens): a point mass q, so the rejection sampler's rule
(accept with probability p(d)) keeps the target distribution exactly, as for n-gram drafts.
A sequence gets drafts only when the draft caught up with it in this call and its pages are there
(keeping ``reserve`` pages free for the target); otherwise none, and it decodes plainly. The
catch-up forward computes at most ``max_catch_up`` tokens in all (the engine's step budget, which
its memory plan measured): after steps without proposals (the batch above
``disable_by_batch_size``) every sequence is far behind, and one forward over all of them would be
a prefill of any size; sequences past the budget catch up in the next calls, oldest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from qserve.request import Request
from qserve.runner.model_runner import ModelRunner
from qserve.sampling_params import SamplingParams
from qserve.scheduler.kv_cache_manager import KVCacheManager
from qserve.scheduler.output import ScheduledSequence, SchedulerOutput
from qserve.spec_decode.proposer import ProposalInput, Proposer

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def alias_kv_caches(
    target: list[tuple[torch.Tensor, torch.Tensor]], num_layers: int, num_kv_heads: int, head_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The draft's per-layer (K, V) ``[num_blocks, block_size, num_kv_heads, head_size]`` as views
    of the target's first ``num_layers`` layers (same blocks, same dtype); ValueError when the
    draft's KV does not fit in the target's."""
    if num_layers > len(target):
        raise ValueError(
            f"speculative_config.model has {num_layers} layers, more than the target's {len(target)}: its KV "
            "cannot share the target's pages"
        )
    aliased = []
    for key, value in target[:num_layers]:
        num_blocks, block_size, target_heads, target_size = key.shape
        if num_kv_heads * head_size > target_heads * target_size or key.stride(1) != target_heads * target_size:
            raise ValueError(
                f"speculative_config.model's KV per token ({num_kv_heads} heads x {head_size}) does not fit in the "
                f"target's ({target_heads} x {target_size})"
            )
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        aliased.append(
            tuple(
                torch.as_strided(t, shape, (t.stride(0), t.stride(1), head_size, 1), t.storage_offset())
                for t in (key, value)
            )
        )
    return aliased


def draft_params(params: SamplingParams | None) -> SamplingParams:
    """The draft's sampling of a request: greedy over the request's own logit processing
    (penalties, logit_bias, min_tokens), so its argmax is the likeliest token of the target's p."""
    if params is None:
        return GREEDY
    return params.clone(
        n=1, temperature=0.0, seed=None, logprobs=None, prompt_logprobs=None, structured_outputs=None, max_tokens=None
    )


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_catch_up: int) -> None:
        self.runner = runner
        self.kv = kv
        self.max_catch_up = max_catch_up
        self._mirrors: dict[str, Request] = {}
        self._synced: dict[str, int] = {}  # outputs of the target known at the last proposal

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
        return mirror

    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
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
            # a page per sequence stays free for the target: its tokens come before the drafts'
            if not self.kv.allocate_slots(mirror, catch_up + max(k - 1, 0), reserve=len(batch)):
                continue
            budget -= catch_up
            self.kv.free_tail(mirror, mirror.num_computed_tokens + catch_up + max(k - 1, 0))
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
            block_ids=self.kv.block_table(mirror.request_id),
            prompt_token_ids=mirror.prompt_token_ids,
            output_token_ids=mirror.output_token_ids,
            sampling_params=mirror.sampling_params,
            sample=sample,
        )

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            mirror = self._mirrors.pop(request_id, None)
            self._synced.pop(request_id, None)
            if mirror is not None:
                self.kv.free(mirror)
