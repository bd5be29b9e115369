"""The scheduler's side of speculative decoding (pure Python, exact block ids): draft tokens are
scheduled after a decode's last token with KV slots for them, only accepted tokens count as
computed (and reach the prefix cache), the pages only rejected drafts reached go back to the pool,
drafts never push past the token budget, max_model_len or the pool, and a request without pages
for its drafts decodes plainly instead of preempting anyone."""

from __future__ import annotations

import pytest

from qserve.request import RequestStatus
from qserve.scheduler import RunnerOutput
from qserve.scheduler.prefix_cache import hash_block_tokens, owner_seed
from tests.unit.scheduler.fakes import make_request, make_scheduler


def _verified(scheduler_output, emitted: dict[str, list[int]]) -> RunnerOutput:
    """The runner's answer: ``emitted[rid]`` for sequences with drafts, token 7 for the others."""
    sampled = {}
    spec = {}
    for seq in scheduler_output.sequences:
        if seq.spec_token_ids:
            spec[seq.request_id] = emitted[seq.request_id]
            sampled[seq.request_id] = emitted[seq.request_id][-1]
        elif seq.sample:
            sampled[seq.request_id] = 7
    return RunnerOutput(sampled, {}, {}, spec_token_ids=spec)


def _decoding(scheduler, request_id: str, prompt: list[int], **kwargs):  # noqa: ANN202
    request = make_request(request_id, prompt, **kwargs)
    scheduler.add_request(request)
    out = scheduler.schedule()  # the prefill
    scheduler.update_from_output(out, _verified(out, {}))
    return request


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_get_slots_and_rejected_ones_give_them_back(async_scheduling):
    scheduler, pool = make_scheduler(num_blocks=16, block_size=4)
    scheduler.async_scheduling = async_scheduling
    request = _decoding(scheduler, "a", [1, 2, 3, 4, 5, 6])  # 6 prompt tokens + token 7: 7 tokens, 2 blocks
    assert request.num_computed_tokens == 6 and len(scheduler.kv_cache_manager.block_table("a")) == 2
    request.spec_token_ids = [8, 9, 10, 11]
    out = scheduler.schedule()
    (seq,) = out.sequences
    assert (seq.start_position, seq.num_new_tokens, list(seq.spec_token_ids)) == (6, 5, [8, 9, 10, 11])
    assert out.num_spec_tokens == 4 and out.num_batched_tokens == 5
    assert seq.input_token_ids() == [7, 8, 9, 10, 11]
    assert len(seq.block_ids) == 3  # positions 6..10 need blocks 1 and 2
    assert request.spec_token_ids == []  # consumed
    free_before = pool.num_free_blocks
    # one draft kept (8), then the target's own token 5: tokens 1..6,7,8,5 = 9 tokens
    new = scheduler.update_from_output(out, _verified(out, {"a": [8, 5]}))
    assert new == [request] and request.output_token_ids == [7, 8, 5]
    assert request.num_computed_tokens == 8  # positions 0..7 (through the kept draft) hold valid KV
    assert len(scheduler.kv_cache_manager.block_table("a")) == 3  # 9 tokens: the next decode writes position 8
    assert pool.num_free_blocks == free_before
    if async_scheduling:
        assert request.num_output_placeholders == 0
    # all rejected: the block the drafts reached goes back
    request.spec_token_ids = [1, 2, 3, 4]
    out = scheduler.schedule()
    assert out.sequences[0].num_new_tokens == 5 and len(out.sequences[0].block_ids) == 4
    scheduler.update_from_output(out, _verified(out, {"a": [6]}))
    assert request.num_computed_tokens == 9 and request.num_tokens == 10
    assert len(scheduler.kv_cache_manager.block_table("a")) == 3 and pool.num_free_blocks == free_before
    # the next plain decode continues at the first unknown position
    out = scheduler.schedule()
    assert (out.sequences[0].start_position, out.sequences[0].num_new_tokens, out.num_spec_tokens) == (9, 1, 0)


def test_only_accepted_tokens_reach_the_prefix_cache():
    scheduler, pool = make_scheduler(num_blocks=16, block_size=4)
    kv = scheduler.kv_cache_manager
    request = _decoding(scheduler, "a", [1, 2, 3])  # tokens 1,2,3,7; computed 3
    request.spec_token_ids = [20, 21, 22, 23, 24]  # positions 4..8: block 1 gets draft KV
    out = scheduler.schedule()
    scheduler.update_from_output(out, _verified(out, {"a": [9]}))  # every draft rejected
    # tokens 1,2,3,7,9; computed 4: block 0 (1,2,3,7) is cached, block 1 (drafts' KV) is not
    assert request.num_computed_tokens == 4 and pool.num_cached_blocks == 1
    assert pool.block_hash(kv.block_table("a")[1]) is None
    request.spec_token_ids = [30, 31, 32]
    out = scheduler.schedule()
    scheduler.update_from_output(out, _verified(out, {"a": [30, 31, 40]}))  # two kept, then 40
    assert request.num_computed_tokens == 7 and pool.num_cached_blocks == 1  # block 1 not full of KV yet
    request.spec_token_ids = [50]
    out = scheduler.schedule()
    scheduler.update_from_output(out, _verified(out, {"a": [50, 51]}))
    assert request.output_token_ids == [7, 9, 30, 31, 40, 50, 51] and request.num_computed_tokens == 9
    assert pool.num_cached_blocks == 2
    first = hash_block_tokens(owner_seed(kv.owner), [1, 2, 3, 7])
    assert pool.block_hash(kv.block_table("a")[1]) == hash_block_tokens(first, [9, 30, 31, 40])


def test_drafts_fit_the_budget_max_model_len_and_only_decodes():
    scheduler, _ = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=4, max_model_len=10)
    a = _decoding(scheduler, "a", [1, 2, 3])  # 4 tokens
    a.spec_token_ids = [1, 2, 3, 4, 5, 6]
    out = scheduler.schedule()
    assert out.sequences[0].spec_token_ids == [1, 2, 3]  # a budget of 4 tokens: 1 + 3 drafts
    scheduler.update_from_output(out, _verified(out, {"a": [1, 2, 3, 4]}))  # 8 tokens
    a.spec_token_ids = [5, 6, 7]
    out = scheduler.schedule()
    assert out.sequences[0].spec_token_ids == [5]  # max_model_len 10: 8 + 1 draft + its token
    scheduler.update_from_output(out, _verified(out, {"a": [5, 6]}))
    assert a.num_tokens == 10
    # a request still prefilling gets none
    b = make_request("b", list(range(10)), arrival_index=1)
    scheduler.add_request(b)
    scheduler.finish_request("a", RequestStatus.FINISHED_LENGTH)
    b.spec_token_ids = [1, 2]
    out = scheduler.schedule()
    assert out.num_spec_tokens == 0 and out.sequences[0].num_new_tokens == 4


def test_no_pages_for_drafts_means_a_plain_decode_not_a_preemption():
    scheduler, pool = make_scheduler(num_blocks=4, block_size=4)
    a = _decoding(scheduler, "a", [1, 2, 3, 4, 5, 6])  # 7 tokens, 2 blocks (8 after the next step)
    b = make_request("b", [11, 12, 13, 14, 15, 16, 17], arrival_index=1)
    scheduler.add_request(b)
    out = scheduler.schedule()
    scheduler.update_from_output(out, _verified(out, {}))
    assert pool.num_free_blocks == 0
    a.spec_token_ids = [1, 2, 3]  # would need a third block
    out = scheduler.schedule()
    assert out.num_spec_tokens == 0 and not out.preempted_request_ids
    assert [s.request_id for s in out.sequences] == ["a", "b"]
