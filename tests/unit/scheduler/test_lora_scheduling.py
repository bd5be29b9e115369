"""LoRA in the scheduler (pure Python): at most ``max_loras`` distinct adapters among the running
requests (a request for another adapter waits; requests behind it that fit go ahead), each scheduled
sequence carries its adapter, and prefix-cache blocks are keyed by adapter."""

from __future__ import annotations

from qserve.request import RequestStatus

from .fakes import make_request, make_scheduler, scheduled, step


def _on(request, lora_id):
    request.lora_id = lora_id
    return request


def test_max_loras_holds_back_a_third_adapter_but_not_the_base() -> None:
    sched, _ = make_scheduler(num_blocks=64)
    sched.max_loras = 2
    for i, lora in enumerate([1, 2, 3, None, 1]):
        sched.add_request(_on(make_request(f"r{i}", [10 + i] * 5, arrival_index=i), lora))
    out = step(sched)
    assert sorted(scheduled(out)) == ["r0", "r1", "r3", "r4"]  # r2 (a third adapter) waits, later ones pass it
    assert {s.request_id: s.lora_id for s in out.sequences} == {"r0": 1, "r1": 2, "r3": None, "r4": 1}
    assert sched.get_request("r2").status == RequestStatus.WAITING
    sched.finish_request("r1", RequestStatus.FINISHED_STOPPED)  # adapter 2 leaves: 3 fits now
    out = step(sched)
    assert "r2" in scheduled(out) and out.sequences[-1].lora_id == 3


def test_prefix_cache_never_crosses_adapters() -> None:
    sched, _ = make_scheduler(num_blocks=64, block_size=4)
    kv = sched.kv_cache_manager
    prompt = list(range(13))  # three full blocks
    first = _on(make_request("a", prompt), 1)
    sched.add_request(first)
    step(sched)
    kv.cache_full_blocks(first)
    for rid, lora, hit in (("b", 2, 0), ("base", None, 0), ("a2", 1, 12)):
        probe = _on(make_request(rid, prompt), lora)
        assert kv.get_computed_blocks(probe)[1] == hit, rid
    assert sched._scheduled(first, 1).lora_id == 1  # noqa: SLF001


def test_passing_over_an_adapter_keeps_tenant_seat_caps() -> None:
    """A waiting request held back for an adapter slot lets the ones behind it go, but only those
    the tenant pick allows: a tenant at its seat cap stays at it."""
    sched, _ = make_scheduler(num_blocks=64)
    sched.max_loras = 1
    sched.set_tenants({"a": 1.0, "b": 1.0}, {"a": 1})
    for i, (tenant, lora) in enumerate([("a", None), ("b", 1), ("b", 2), ("a", None), ("b", None)]):
        request = _on(make_request(f"r{i}", [10 + i] * 5, arrival_index=i), lora)
        request.tenant = tenant
        sched.add_request(request)
    out = step(sched)
    # r0 (a) and r1 (b, adapter 1) run; r2 waits for a slot; r3 is a's second (cap 1); r4 goes
    assert sorted(scheduled(out)) == ["r0", "r1", "r4"]
    assert sched.get_request("r3").status == RequestStatus.WAITING
