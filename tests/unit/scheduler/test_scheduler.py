"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption by recompute, FCFS, abort/finish."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qserve.request import RequestStatus
from qserve.scheduler import BlockPool, KVCacheManager, OwnerShare, Scheduler

from .fakes import SAMPLED_TOKEN, fake_run, make_request, make_scheduler, scheduled, step


def _prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_chunked_prefill_under_token_budget_while_decodes_continue() -> None:
    sched, pool = make_scheduler(num_blocks=32, max_num_batched_tokens=8)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("A", _prompt(3), arrival_index=0))
    out = step(sched)
    assert scheduled(out) == {"A": (0, 3, True)}
    assert out.num_batched_tokens == 3 and out.sequences[0].block_ids == [0]
    sched.add_request(make_request("B", _prompt(20, 100), arrival_index=1))

    out = step(sched)  # A decodes first (FCFS), B takes the rest of the budget
    assert scheduled(out) == {"A": (3, 1, True), "B": (0, 7, False)}
    assert out.num_batched_tokens == 8
    assert kv.block_table("A") == [0] and kv.block_table("B") == [1, 2]
    assert out.sequences[1].input_token_ids() == _prompt(7, 100)

    out = step(sched)
    assert scheduled(out) == {"A": (4, 1, True), "B": (7, 7, False)}
    assert kv.block_table("A") == [0, 3] and kv.block_table("B") == [1, 2, 4, 5]

    out = step(sched)  # B's last chunk reaches its last token: sample
    assert scheduled(out) == {"A": (5, 1, True), "B": (14, 6, True)}
    assert out.num_batched_tokens == 7
    assert kv.block_table("B") == [1, 2, 4, 5, 6]
    assert sched.get_request("B").output_token_ids == [SAMPLED_TOKEN]

    out = step(sched)
    assert scheduled(out) == {"A": (6, 1, True), "B": (20, 1, True)}
    assert sched.get_request("A").output_token_ids == [SAMPLED_TOKEN] * 5
    assert sched.get_request("A").num_computed_tokens == 7


def test_budget_exhausted_by_older_requests_leaves_newer_running_ones_for_next_step() -> None:
    sched, _ = make_scheduler(num_blocks=32, max_num_batched_tokens=4)
    sched.add_request(make_request("A", _prompt(6), arrival_index=0))
    sched.add_request(make_request("B", _prompt(2, 50), arrival_index=1))
    assert scheduled(step(sched)) == {"A": (0, 4, False)}
    assert scheduled(step(sched)) == {"A": (4, 2, True), "B": (0, 2, True)}
    assert scheduled(step(sched)) == {"A": (6, 1, True), "B": (2, 1, True)}


def test_max_num_seqs_caps_running_requests() -> None:
    sched, pool = make_scheduler(num_blocks=32, max_num_seqs=2)
    for i, rid in enumerate("ABC"):
        sched.add_request(make_request(rid, _prompt(5, 10 * i), arrival_index=i, max_tokens=2))
    out = step(sched)
    assert set(scheduled(out)) == {"A", "B"}
    assert sched.num_running == 2 and sched.num_waiting == 1
    out = step(sched)  # A and B reach max_tokens=2 and are finished by the "engine"
    assert set(scheduled(out)) == {"A", "B"}
    assert sched.num_running == 0
    out = step(sched)
    assert scheduled(out) == {"C": (0, 5, True)}
    assert out.finished_request_ids == ["A", "B"]


def test_preempt_newest_when_pages_run_out_then_readmit_and_recompute() -> None:
    sched, pool = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("A", _prompt(6), arrival_index=0, max_tokens=5))
    sched.add_request(make_request("B", _prompt(6, 100), arrival_index=1, max_tokens=4))
    step(sched)
    assert kv.block_table("A") == [0, 1] and kv.block_table("B") == [2, 3]
    step(sched)
    step(sched)  # both hold 8 computed tokens, 9 known: the pool is full
    assert pool.num_free_blocks == 0

    out = step(sched)  # A needs a third block: B (newest) is preempted, its blocks returned tail first
    assert out.preempted_request_ids == ["B"]
    assert scheduled(out) == {"A": (8, 1, True)}
    b = sched.get_request("B")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [SAMPLED_TOKEN] * 3  # kept: recomputed on re-admission
    assert kv.block_table("B") == []
    assert kv.block_table("A") == [0, 1, 3]  # B's tail block went first to the free queue head
    assert pool.free_block_ids() == [2]  # B's first block, still cached
    assert sched.num_waiting == 1

    out = step(sched)  # A reaches max_tokens=5 -> finished this step; B cannot fit yet
    assert scheduled(out) == {"A": (9, 1, True)}
    assert sched.get_request("A") is None
    assert pool.free_block_ids() == [2, 3, 1, 0]  # A's pages returned the same step

    out = step(sched)  # B re-admitted: its own cached first block hit, the rest recomputed incl. outputs
    assert scheduled(out) == {"B": (4, 5, True)}
    assert b.num_cached_tokens == 4
    assert out.sequences[0].block_ids == [2, 3, 1]
    assert out.sequences[0].input_token_ids() == [104, 105, SAMPLED_TOKEN, SAMPLED_TOKEN, SAMPLED_TOKEN]
    assert b.status == RequestStatus.FINISHED_LENGTH  # 4th token sampled: done
    assert pool.num_free_blocks == 4 and not sched.has_unfinished_requests()


def test_request_that_is_itself_the_newest_preempts_itself_and_stops_running_loop() -> None:
    sched, pool = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    sched.add_request(make_request("A", _prompt(5), arrival_index=0))
    sched.add_request(make_request("B", _prompt(8, 100), arrival_index=1))
    step(sched)
    assert sched.kv_cache_manager.block_table("B") == [2, 3]
    out = step(sched)  # A fits (6 tokens in 2 blocks); B needs a 3rd block: B is the newest
    assert scheduled(out) == {"A": (5, 1, True)}
    assert out.preempted_request_ids == ["B"]
    assert pool.free_block_ids() == [3, 2]
    out = step(sched)  # B (prompt + 1 output = 9 tokens) needs 3 blocks, 2 are free: it waits
    assert scheduled(out) == {"A": (6, 1, True)}
    assert sched.num_waiting == 1
    sched.abort_request("A")
    out = step(sched)
    assert scheduled(out) == {"B": (0, 9, True)}  # recompute prompt + its 1 output, no prefix cache
    assert sched.kv_cache_manager.block_table("B") == [3, 2, 1]


def test_preempted_requests_keep_fcfs_order_in_waiting_queue() -> None:
    sched, pool = make_scheduler(num_blocks=3, block_size=2, enable_prefix_caching=False)
    for i, rid in enumerate("ABC"):
        sched.add_request(make_request(rid, _prompt(2, 10 * i), arrival_index=i))
    step(sched)
    assert [r.request_id for r in sched.running] == ["A", "B", "C"] and pool.num_free_blocks == 0
    out = step(sched)  # A needs a 2nd block: C preempted; B needs one too: nothing left but B itself
    assert out.preempted_request_ids == ["C", "B"]
    assert [r.request_id for r in sched.waiting] == ["B", "C"]
    assert scheduled(out) == {"A": (2, 1, True)}


def test_fcfs_admission_stops_when_pages_are_short() -> None:
    sched, pool = make_scheduler(num_blocks=4)
    sched.add_request(make_request("A", _prompt(12), arrival_index=0))
    sched.add_request(make_request("B", _prompt(8, 100), arrival_index=1))
    sched.add_request(make_request("C", _prompt(2, 200), arrival_index=2))
    out = step(sched)
    assert scheduled(out) == {"A": (0, 12, True)}  # C would fit but may not jump over B
    assert sched.kv_cache_manager.block_table("A") == [0, 1, 2]
    assert [r.request_id for r in sched.waiting] == ["B", "C"]
    sched.finish_request("A", RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    assert scheduled(out) == {"B": (0, 8, True), "C": (0, 2, True)}
    assert out.finished_request_ids == ["A"]


def test_abort_and_finish_free_pages_the_same_step() -> None:
    sched, pool = make_scheduler(num_blocks=8)
    sched.add_request(make_request("A", _prompt(6), arrival_index=0))
    sched.add_request(make_request("B", _prompt(6, 50), arrival_index=1))
    sched.add_request(make_request("W", _prompt(30, 90), arrival_index=2))  # waits: 8 blocks needed
    step(sched)
    assert pool.num_free_blocks == 4 and sched.num_waiting == 1
    aborted = sched.abort_request("A")
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert pool.num_free_blocks == 6 and pool.num_used_by("default") == 2
    assert sched.abort_request("A") is None  # idempotent
    assert sched.abort_request("W").status == RequestStatus.FINISHED_ABORTED
    assert sched.num_waiting == 0
    out = sched.schedule()
    finished = sched.finish_request("B", RequestStatus.FINISHED_STOPPED)  # between schedule and update
    assert finished.status == RequestStatus.FINISHED_STOPPED
    assert pool.num_free_blocks == 8
    assert sched.update_from_output(out, fake_run(out)) == []  # finished request skipped
    assert finished.output_token_ids == [SAMPLED_TOKEN]
    assert sched.schedule().finished_request_ids == ["B"]
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_request("B", RequestStatus.RUNNING)


def test_add_request_refuses_what_can_never_run() -> None:
    sched, _ = make_scheduler(num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match="prompt of 17 tokens can never fit .* at most 16 tokens"):
        sched.add_request(make_request("big", _prompt(17)))
    with pytest.raises(ValueError, match="prompt of 33 tokens exceeds max_model_len=32"):
        sched.add_request(make_request("long", _prompt(33)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("ok", _prompt(16)))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("ok", _prompt(3)))
    assert sched.num_waiting == 1


def test_request_outgrowing_the_pool_is_finished_not_deadlocked() -> None:
    sched, pool = make_scheduler(num_blocks=2)  # 8 tokens at most
    sched.add_request(make_request("A", _prompt(7), max_tokens=100))
    step(sched)  # 8 tokens known
    step(sched)  # 9 known: can never fit
    out = step(sched)
    assert out.capacity_finished_request_ids == ["A"] and out.finished_request_ids == ["A"]
    assert not out.sequences
    assert pool.num_free_blocks == 2 and not sched.has_unfinished_requests()


def test_two_models_share_one_pool_with_shares() -> None:
    pool = BlockPool(8, shares={"a": OwnerShare(min_blocks=2, max_blocks=6), "b": OwnerShare(min_blocks=2)})
    sa = Scheduler(KVCacheManager(pool, 4, owner="a"), 8, 64, 64)
    sb = Scheduler(KVCacheManager(pool, 4, owner="b"), 8, 64, 64)
    with pytest.raises(ValueError, match="at most 24 tokens"):  # a's max is 6 blocks
        sa.add_request(make_request("too-big", _prompt(25)))
    sa.add_request(make_request("a1", _prompt(24)))
    sb.add_request(make_request("b1", _prompt(8)))
    step(sa)
    assert pool.num_used_by("a") == 6 and pool.num_free_blocks == 2
    step(sb)
    assert sb.kv_cache_manager.block_table("b1") == [6, 7] and pool.num_used_by("b") == 2
    sa.finish_request("a1", RequestStatus.FINISHED_STOPPED)
    sb.finish_request("b1", RequestStatus.FINISHED_STOPPED)
    assert pool.num_free_blocks == 8


def test_workload_runs_to_completion_and_pool_is_full_again() -> None:
    sched, pool = make_scheduler(num_blocks=10, max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(8):
        shared = _prompt(8)  # two shared full blocks exercise the prefix cache under pressure
        sched.add_request(make_request(f"r{i}", shared + _prompt(3 + i, 100 * i), arrival_index=i, max_tokens=5 + i))
    requests = [sched.get_request(f"r{i}") for i in range(8)]
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        assert out.num_batched_tokens <= 10 and len(out.sequences) <= 3
        assert sched.num_running <= 3
    assert not sched.has_unfinished_requests()
    assert pool.num_free_blocks == 10 and pool.num_used_by("default") == 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert [r.num_output_tokens for r in requests] == [5 + i for i in range(8)]
    assert sched.kv_cache_manager.num_prefix_hits > 0


def test_scheduler_package_does_not_import_torch() -> None:
    code = "import sys, qserve.scheduler; assert 'torch' not in sys.modules, 'qserve.scheduler imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_aborting_a_huge_waiting_queue_is_linear() -> None:
    """Aborts are O(1) each (a deque.remove per abort made 50k aborts, newest first, take minutes
    and stalled the step thread that serves every model)."""
    import time

    sched, pool = make_scheduler(num_blocks=8)
    num = 50_000
    for i in range(num):
        sched.add_request(make_request(f"r{i}", _prompt(4, i % 100), arrival_index=i))
    start = time.perf_counter()
    for i in reversed(range(1, num)):
        sched.abort_request(f"r{i}")
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{num - 1} aborts took {elapsed:.1f} s"
    assert sched.num_waiting == 1 and [r.request_id for r in sched.waiting] == ["r0"]
    out = step(sched)
    assert scheduled(out) == {"r0": (0, 4, True)}
    assert len(out.finished_request_ids) == num - 1
    sched.abort_request("r0")
    step(sched)
    assert pool.num_free_blocks == 8 and not sched.has_unfinished_requests()


def test_finishing_running_requests_keeps_arrival_order() -> None:
    sched, _ = make_scheduler(num_blocks=16)
    for i, rid in enumerate("ABCDE"):
        sched.add_request(make_request(rid, _prompt(2, 10 * i), arrival_index=i))
    step(sched)
    sched.finish_request("C", RequestStatus.FINISHED_STOPPED)
    sched.abort_request("A")
    assert [r.request_id for r in sched.running] == ["B", "D", "E"]
    sched.finish_request("E", RequestStatus.FINISHED_LENGTH)
    assert [r.request_id for r in sched.running] == ["B", "D"]
