"""Swap preemption in the scheduler (issue 17, item 6): which blocks go to which host slots and back,
checked against a fake KV memory that the swaps really copy."""

from __future__ import annotations

import pytest

from qserve.request import RequestStatus
from qserve.scheduler import Scheduler, SchedulerOutput
from qserve.scheduler.swap import HostSwapSpace, SwapCost
from tests.unit.scheduler.fakes import fake_run, make_request, make_scheduler


class FakeKV:
    """Device pages and host slots holding ``(request_id, position, token)`` per token slot: a step
    applies its swaps like the runner (out first, then in), checks that every position a sequence
    reads is there, then writes the positions it computes."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def run(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        for block, slot in out.blocks_to_swap_out:
            self.host[slot] = list(self.device[block])
        for slot, block in out.blocks_to_swap_in:
            self.device[block] = list(self.host[slot])
        bs = self.block_size
        for seq in out.sequences:
            request = scheduler.requests[seq.request_id]
            for p in range(seq.start_position):  # the KV this step's attention reads
                got = self.device[seq.block_ids[p // bs]][p % bs]
                assert got == (seq.request_id, p, request.token_at(p)), f"{seq.request_id} position {p}: {got}"
            for p in range(seq.start_position, seq.start_position + seq.num_new_tokens):
                self.device.setdefault(seq.block_ids[p // bs], [None] * bs)[p % bs] = (
                    seq.request_id,
                    p,
                    request.token_at(p),
                )


def _run(mode: str, num_slots: int = 64, cost: SwapCost | None = None, abort_swapped: bool = False) -> dict:
    """8 requests growing from 8 to 40 tokens on 24 blocks of 4 tokens (preemption must happen)."""
    scheduler, pool = make_scheduler(num_blocks=24, max_num_seqs=8, enable_prefix_caching=False)
    space = HostSwapSpace(num_slots)
    if mode != "recompute":
        scheduler.set_preemption_mode(mode, space, cost)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", [10 + i] * 8, arrival_index=i, max_tokens=32))
    kv = FakeKV(block_size=4)
    stats = {"preempted": 0, "swapped_out": 0, "tokens": 0, "outputs": {}, "aborted": None}
    for _ in range(400):
        out = scheduler.schedule()
        kv.run(scheduler, out)
        stats["preempted"] += len(out.preempted_request_ids)
        stats["swapped_out"] += len(out.swapped_out_request_ids)
        stats["tokens"] += out.num_batched_tokens
        for request in scheduler.update_from_output(out, fake_run(out)):
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                stats["outputs"][request.request_id] = list(request.output_token_ids)
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        if abort_swapped and stats["aborted"] is None and out.swapped_out_request_ids:
            victim = out.swapped_out_request_ids[0]
            held = space.num_slots - space.num_free_slots
            scheduler.abort_request(victim)
            stats["aborted"] = (victim, held, space.num_slots - space.num_free_slots)
        if not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests() and pool.num_free_blocks == 24
    stats["host_free_at_end"] = space.num_free_slots
    stats["num_swapped_out"], stats["num_swapped_in"] = scheduler.num_swapped_out, scheduler.num_swapped_in
    return stats


def test_swap_moves_kv_out_and_back_without_recomputing():
    recompute = _run("recompute")
    swap = _run("swap")
    assert recompute["preempted"] > 0 and swap["preempted"] > 0
    assert swap["swapped_out"] == swap["preempted"] == swap["num_swapped_out"] == swap["num_swapped_in"]
    assert swap["outputs"] == recompute["outputs"]
    # Nothing recomputed: every token of prompt and outputs was computed exactly once.
    assert swap["tokens"] == 8 * (8 + 31)
    assert recompute["tokens"] > swap["tokens"]
    assert swap["host_free_at_end"] == 64


def test_a_full_host_pool_falls_back_to_recompute():
    # One slot: a victim holding 2+ computed blocks cannot go to the host.
    full = _run("swap", num_slots=1)
    assert full["preempted"] > 0 and full["swapped_out"] == 0
    assert full["tokens"] == _run("recompute")["tokens"]


def test_aborting_a_swapped_request_frees_its_host_slots():
    stats = _run("swap", abort_swapped=True)
    victim, held_before, held_after = stats["aborted"]
    assert victim not in stats["outputs"]
    assert held_before > held_after
    assert stats["host_free_at_end"] == 64


@pytest.mark.parametrize(
    ("bandwidth", "swaps"), [(1e12, True), (1.0, False)], ids=["fast-link-swaps", "slow-link-recomputes"]
)
def test_auto_swaps_only_where_the_estimate_says_it_is_cheaper(bandwidth, swaps):
    cost = SwapCost(block_bytes=1 << 20, bandwidth_bytes_per_s=bandwidth, recompute_seconds_per_token=1e-4)
    stats = _run("auto", cost=cost)
    assert stats["preempted"] > 0
    assert (stats["swapped_out"] == stats["preempted"]) if swaps else (stats["swapped_out"] == 0)


def test_swap_cost_formula():
    cost = SwapCost(block_bytes=1000, bandwidth_bytes_per_s=1e6, recompute_seconds_per_token=1e-3)
    assert cost.swap_seconds(3) == pytest.approx(2 * 3 * 1000 / 1e6)
    assert cost.recompute_seconds(10) == pytest.approx(1e-2)
    assert cost.prefer_swap(3, 10) and not cost.prefer_swap(3, 5)


def test_swapped_request_resumes_at_its_position_on_new_pages():
    scheduler, pool = make_scheduler(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    scheduler.set_preemption_mode("swap", HostSwapSpace(8))
    old, new = make_request("old", [1] * 7, arrival_index=0), make_request("new", [2] * 6, arrival_index=1)
    scheduler.add_request(old)
    scheduler.add_request(new)
    out = scheduler.schedule()  # old: 2 blocks, new: 2 blocks: the pool is full
    scheduler.update_from_output(out, fake_run(out))
    new_table = list(scheduler.kv_cache_manager.block_table("new"))
    out = scheduler.schedule()  # old (8 tokens) fits its 2 blocks; new grows to 7 tokens, still fits
    scheduler.update_from_output(out, fake_run(out))
    out = scheduler.schedule()  # old needs a 3rd block: new (newest) is swapped out
    assert out.preempted_request_ids == ["new"] == out.swapped_out_request_ids
    assert out.blocks_to_swap_out == list(zip(new_table, [0, 1]))
    assert new.status == RequestStatus.SWAPPED and new.num_computed_tokens == 7 and scheduler.num_swapped == 1
    assert scheduler.kv_cache_manager.block_table("new") == []
    scheduler.update_from_output(out, fake_run(out))
    scheduler.finish_request("old", RequestStatus.FINISHED_STOPPED)
    out = scheduler.schedule()
    table = scheduler.kv_cache_manager.block_table("new")
    assert out.blocks_to_swap_in == list(zip([0, 1], table))
    assert [(s.request_id, s.start_position, s.num_new_tokens) for s in out.sequences] == [("new", 7, 1)]
    assert new.status == RequestStatus.RUNNING and scheduler.num_swapped == 0


def test_host_slots_lowest_first_and_reused_only_after_the_step():
    space = HostSwapSpace(4)
    assert space.swap_out("a", 2) == [0, 1] and space.swap_out("b", 1) == [2]
    assert space.swap_out("c", 2) is None  # one left: nothing taken
    assert space.swap_in("a") == [0, 1]
    assert space.swap_out("c", 2) is None  # a's slots are still being copied back this step
    space.end_step()
    assert space.swap_out("c", 3) == [0, 1, 3]
    space.release("b")
    assert space.num_free_slots == 1 and space.num_swapped == 1


def test_bad_modes_are_refused_naming_the_flag():
    scheduler, _ = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError, match="preemption_mode"):
        scheduler.set_preemption_mode("swapp", HostSwapSpace(2))
    with pytest.raises(ValueError, match="swap_space"):
        scheduler.set_preemption_mode("swap")
    with pytest.raises(ValueError, match="cost"):
        scheduler.set_preemption_mode("auto", HostSwapSpace(2))
