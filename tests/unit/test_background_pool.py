"""tests/helpers/result_scripts.py's ``BackgroundPool``: the launch-compile drives and scripts the
session queues at collection run in order, at most ``workers`` at a time, niced; a shutdown kills what
runs and cancels what waits (an interrupted session leaves no process behind)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.helpers.result_scripts import BackgroundJob, BackgroundPool, script_env

# prints when it started and its niceness, then sleeps
_CHILD = "import os, sys, time; print(time.monotonic(), os.nice(0), flush=True); time.sleep(float(sys.argv[1]))"


def _job(tmp_path, name: str, seconds: float) -> BackgroundJob:
    return BackgroundJob([sys.executable, "-c", _CHILD, str(seconds)], script_env(), tmp_path / f"{name}.out")


def test_jobs_run_in_order_two_at_a_time_niced(tmp_path):
    pool = BackgroundPool(workers=2)
    try:
        jobs = [pool.submit(_job(tmp_path, f"j{i}", 1.5)) for i in range(3)]
        assert [job.wait(timeout=60) for job in jobs] == [0, 0, 0]
    finally:
        pool.shutdown()
    started = [float(job.stdout.read_text().split()[0]) for job in jobs]
    nice = {int(job.stdout.read_text().split()[1]) for job in jobs}
    assert nice == {min(19, os.nice(0) + 10)}  # 10 below this process, whatever its own niceness
    assert started[1] < started[0] + 1.5  # the second began before the first ended: side by side
    assert started[2] > min(started[:2]) + 1.4  # the third only when a worker came free


def test_shutdown_kills_the_running_and_cancels_the_waiting(tmp_path):
    pool = BackgroundPool(workers=1)
    try:
        running, waiting = pool.submit(_job(tmp_path, "long", 60)), pool.submit(_job(tmp_path, "next", 0))
        deadline = time.monotonic() + 30
        while running.proc is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pool.shutdown()
    assert running.wait(timeout=10) != 0  # killed
    assert waiting.wait(timeout=10) is None and waiting.proc is None  # never started


def test_a_job_that_cannot_start_fails_its_waiter_and_the_next_job_still_runs(tmp_path):
    """A failed start (here a missing program) must not take the worker down with it: every job
    queued behind it on that worker would wait out the test's whole timeout."""
    pool = BackgroundPool(workers=1)
    try:
        broken = pool.submit(BackgroundJob([str(tmp_path / "no-such-program")], script_env(), tmp_path / "b.out"))
        after = pool.submit(_job(tmp_path, "after", 0))
        with pytest.raises(RuntimeError, match="could not run"):
            broken.wait(timeout=30)
        assert after.wait(timeout=30) == 0
    finally:
        pool.shutdown()
