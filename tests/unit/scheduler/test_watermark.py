"""Admission watermark (issue 17, item 6): pages kept free for running requests to grow."""

from __future__ import annotations

import pytest

from tests.unit.scheduler.fakes import make_request, make_scheduler, step


def _run(watermark: float, per_running: int) -> tuple[int, int]:
    """(requests admitted in the first steps, preemptions over the whole run) for 8 requests that
    grow from 8 to 40 tokens on a pool of 24 blocks of 4 tokens."""
    scheduler, pool = make_scheduler(num_blocks=24, max_num_seqs=8)
    scheduler.watermark, scheduler.watermark_per_running = watermark, per_running
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", [10 + i] * 8, arrival_index=i, max_tokens=32))
    preemptions = 0
    admitted = 0
    for n in range(200):
        out = step(scheduler)
        preemptions += len(out.preempted_request_ids)
        if n < 3:
            admitted = max(admitted, scheduler.num_running)
        if not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests() and pool.num_free_blocks == 24
    return admitted, preemptions


def test_watermark_admits_fewer_at_once_and_preempts_less():
    admitted_plain, preempted_plain = _run(0.0, 0)
    admitted_wm, preempted_wm = _run(0.05, 2)
    assert admitted_wm < admitted_plain
    assert preempted_wm < preempted_plain


def test_an_idle_model_admits_what_fits_and_bad_watermarks_are_refused():
    scheduler, _ = make_scheduler(num_blocks=4, max_num_seqs=2)
    scheduler.watermark, scheduler.watermark_per_running = 0.5, 4
    scheduler.add_request(make_request("big", [1] * 16, max_tokens=1))  # all 4 blocks
    assert [s.request_id for s in scheduler.schedule().sequences] == ["big"]
    from qserve.scheduler import Scheduler

    with pytest.raises(ValueError, match="watermark"):
        Scheduler(scheduler.kv_cache_manager, 2, 64, 256, watermark=1.5)
