"""Scheduler under async scheduling: step N+1 is scheduled before step N's tokens are known
(placeholders), finished requests' extra tokens are dropped, preempted requests wait for their
in-flight token, and the whole run ends with the same tokens and pages as the synchronous order."""

from __future__ import annotations

import random

from qserve.request import RequestStatus
from qserve.scheduler import RunnerOutput, SchedulerOutput

from .fakes import SAMPLED_TOKEN, fake_run, make_request, make_scheduler, scheduled


def _prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def _async_scheduler(**kwargs):  # noqa: ANN202 - (Scheduler, BlockPool)
    sched, pool = make_scheduler(**kwargs)
    sched.async_scheduling = True
    return sched, pool


def test_next_step_is_planned_on_placeholders_then_filled_in() -> None:
    sched, _ = _async_scheduler(num_blocks=8)
    sched.add_request(make_request("A", _prompt(3)))
    first = sched.schedule()
    a = sched.get_request("A")
    assert scheduled(first) == {"A": (0, 3, True)}
    assert a.num_computed_tokens == 3 and a.num_output_placeholders == 1 and a.output_token_ids == []

    second = sched.schedule()  # before the first step's token is known: a decode of the placeholder
    assert scheduled(second) == {"A": (3, 1, True)}
    assert a.num_computed_tokens == 4 and a.num_output_placeholders == 2

    assert sched.update_from_output(first, fake_run(first)) == [a]
    assert a.output_token_ids == [SAMPLED_TOKEN] and a.num_output_placeholders == 1
    assert a.num_computed_tokens == 4  # not advanced twice
    sched.update_from_output(second, RunnerOutput({"A": 9}, {}, {}))
    assert a.output_token_ids == [SAMPLED_TOKEN, 9] and a.num_output_placeholders == 0


def test_extra_token_of_a_finished_request_is_dropped_and_its_pages_freed() -> None:
    sched, pool = _async_scheduler(num_blocks=8)
    sched.add_request(make_request("A", _prompt(3)))
    first = sched.schedule()
    second = sched.schedule()  # speculative: A may finish at the first step
    a = sched.get_request("A")
    sched.update_from_output(first, fake_run(first))
    sched.finish_request("A", RequestStatus.FINISHED_STOPPED)  # the engine saw a stop token
    assert pool.num_free_blocks == 8
    assert sched.update_from_output(second, fake_run(second)) == []
    assert a.output_token_ids == [SAMPLED_TOKEN]  # the extra token never lands
    assert sched.schedule().is_empty


def test_request_preempted_in_flight_waits_for_its_token() -> None:
    sched, pool = _async_scheduler(num_blocks=3, enable_prefix_caching=False)
    sched.add_request(make_request("A", _prompt(4), arrival_index=0))
    sched.add_request(make_request("B", _prompt(4, 100), arrival_index=1))
    first = sched.schedule()  # one block each; both sample
    second = sched.schedule()  # A's decode needs a block: B (newest) preempted with a token in flight
    assert second.preempted_request_ids == ["B"] and scheduled(second) == {"A": (4, 1, True)}
    b = sched.get_request("B")
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    sched.finish_request("A", RequestStatus.FINISHED_STOPPED)  # pages free again
    assert pool.num_free_blocks == 3
    third = sched.schedule()
    assert third.is_empty  # B is not admitted while its token is unknown
    sched.update_from_output(first, fake_run(first))  # B's token lands while it waits
    assert b.output_token_ids == [SAMPLED_TOKEN] and b.num_output_placeholders == 0
    fourth = sched.schedule()
    assert scheduled(fourth) == {"B": (0, 5, True)}  # prompt + its token, recomputed


def _drive(async_scheduling: bool, seed: int) -> tuple[dict[str, list[int]], int]:
    """Run a random workload to the end through a fake engine loop; returns each request's tokens
    and the steps taken. Tokens depend on the request and position only (a deterministic model)."""
    sched, pool = make_scheduler(num_blocks=10, block_size=2, max_num_seqs=4, max_num_batched_tokens=6)
    sched.async_scheduling = async_scheduling
    rng = random.Random(seed)
    requests = {}
    for i in range(8):
        request = make_request(
            f"r{i}", _prompt(rng.randint(1, 7), 10 * i), arrival_index=i, max_tokens=rng.randint(1, 6)
        )
        requests[request.request_id] = request
        sched.add_request(request)

    def run(out: SchedulerOutput) -> RunnerOutput:
        tokens = {}
        for seq in out.sequences:
            if seq.sample:
                index = seq.start_position + seq.num_new_tokens - len(seq.prompt_token_ids)
                tokens[seq.request_id] = 1000 * int(seq.request_id[1:]) + index
        return RunnerOutput(tokens, {}, {})

    def process(out: SchedulerOutput, result: RunnerOutput) -> None:
        for request in sched.update_from_output(out, result):
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                sched.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)

    in_flight = None
    steps = 0
    while sched.has_unfinished_requests() and steps < 500:
        steps += 1
        out = sched.schedule()
        launched = (out, run(out)) if not out.is_empty else None
        if not async_scheduling and launched is not None:
            process(*launched)
            launched = None
        if in_flight is not None:
            process(*in_flight)
        in_flight = launched
    assert pool.num_free_blocks == 10
    return {rid: r.output_token_ids for rid, r in requests.items()}, steps


def test_same_tokens_as_the_synchronous_order_under_preemption() -> None:
    for seed in range(5):
        sync_tokens, sync_steps = _drive(False, seed)
        async_tokens, async_steps = _drive(True, seed)
        assert async_tokens == sync_tokens
        for rid, tokens in async_tokens.items():
            assert len(tokens) == make_request_max_tokens(seed)[rid]  # no extra token
        assert async_steps >= sync_steps


def make_request_max_tokens(seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    result = {}
    for i in range(8):
        rng.randint(1, 7)
        result[f"r{i}"] = rng.randint(1, 6)
    return result
