"""Seats shared between tenants by weight (issue 17, item 7): pure-Python scheduler tests."""

from __future__ import annotations

from tests.unit.scheduler.fakes import make_request, make_scheduler, step


def _add(scheduler, tenant: str, count: int, start: int, max_tokens: int = 50, prompt_len: int = 4) -> list[str]:
    ids = []
    for i in range(count):
        request = make_request(
            f"{tenant}{start + i}", [1 + i] * prompt_len, arrival_index=start + i, max_tokens=max_tokens
        )
        request.tenant = tenant
        scheduler.add_request(request)
        ids.append(request.request_id)
    return ids


def _running(scheduler) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in scheduler.running:
        counts[request.tenant] = counts.get(request.tenant, 0) + 1
    return counts


def test_a_late_tenant_gets_a_seat_at_once_from_the_flooding_one():
    scheduler, _ = make_scheduler(num_blocks=200, max_num_seqs=4)
    scheduler.set_tenants({"a": 1.0, "b": 1.0})
    _add(scheduler, "a", 8, 0)
    step(scheduler)
    assert _running(scheduler) == {"a": 4}
    (b,) = _add(scheduler, "b", 1, 100)
    out = step(scheduler)
    assert b in [s.request_id for s in out.sequences]  # scheduled in the very next step
    assert out.preempted_request_ids == ["a3"]  # the flooding tenant's newest gave up its seat
    assert _running(scheduler) == {"a": 3, "b": 1}
    step(scheduler)
    assert _running(scheduler) == {"a": 3, "b": 1}  # no thrashing: b has nothing else waiting


def test_seats_follow_the_weights_when_both_flood():
    scheduler, _ = make_scheduler(num_blocks=400, max_num_seqs=8)
    scheduler.set_tenants({"a": 3.0, "b": 1.0})
    _add(scheduler, "b", 10, 0)  # b came first and took every seat
    for _ in range(2):
        step(scheduler)
    assert _running(scheduler) == {"b": 8}
    _add(scheduler, "a", 10, 100)
    for _ in range(6):  # one seat changes hands per step
        step(scheduler)
    assert _running(scheduler) == {"a": 6, "b": 2}


def test_without_tenants_the_order_stays_fcfs_and_nothing_is_preempted():
    scheduler, _ = make_scheduler(num_blocks=200, max_num_seqs=4)
    _add(scheduler, "a", 8, 0)
    step(scheduler)
    _add(scheduler, "b", 1, 100)
    out = step(scheduler)
    assert out.preempted_request_ids == [] and _running(scheduler) == {"a": 4}


def test_max_running_caps_a_tenant_even_with_free_seats():
    scheduler, _ = make_scheduler(num_blocks=200, max_num_seqs=8)
    scheduler.set_tenants({"a": 1.0}, {"a": 2})
    _add(scheduler, "a", 5, 0)
    step(scheduler)
    assert _running(scheduler) == {"a": 2} and scheduler.num_waiting == 3


def test_page_pressure_preempts_the_tenant_holding_most_pages_per_weight():
    # 4-token blocks; each request grows by one block every 4 steps.
    scheduler, pool = make_scheduler(num_blocks=14, max_num_seqs=8)
    scheduler.set_tenants({"a": 1.0, "b": 1.0})
    _add(scheduler, "a", 3, 0, prompt_len=8)  # a: three requests
    _add(scheduler, "b", 1, 10, prompt_len=8)  # b: one, the newest (plain FCFS would preempt it)
    preempted = []
    for _ in range(12):
        preempted += step(scheduler).preempted_request_ids
    assert preempted and all(rid.startswith("a") for rid in preempted)
