"""Graceful shutdown in-process (``drain_app``, what SIGTERM runs): in-flight streams that end
within the window complete normally, the rest end at the deadline with ``finish_reason:
"abort"`` and ``[DONE]``; meanwhile new requests and ``/health`` get 503. Steps are slowed
down so that "short" and "long" do not depend on the machine's speed."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.server.app import create_app, drain_app
from tests.server.conftest import host_config, serve, wait_for
from tests.server.sse_client import start_streams

STEP_DELAY_S = 0.05


@pytest.fixture
def slow_app(checkpoints):
    host = AsyncEngine(build_engines([ModelSpec("llama", checkpoints["llama"])], host_config()))
    engine = host.models["llama"].engine
    step = engine.step

    def slow_step(**kwargs):
        time.sleep(STEP_DELAY_S)
        return step(**kwargs)

    engine.step = slow_step
    return create_app(host, log_stats=False), host


def test_drain_lets_short_streams_finish_and_cuts_long_ones_at_the_deadline(slow_app):
    app, host = slow_app
    with serve(app) as url:
        short, long = start_streams(url, 8, 240)  # ~0.4 s and >= 12 s of steps
        started = time.monotonic()
        draining = asyncio.run_coroutine_threadsafe(drain_app(app, 3.0), host._loop)  # noqa: SLF001
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, timeout=5)
        refused = httpx.post(f"{url}/v1/completions", json={"model": "llama", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert httpx.get(f"{url}/ping").status_code == 503
        assert httpx.get(f"{url}/metrics").status_code == 200  # still scrapeable while draining
        assert draining.result(timeout=20) is False  # the long stream had to be cut
        elapsed = time.monotonic() - started
        for s in (short, long):
            s.join(timeout=10)
        assert short.finish_reason() == "length"
        assert long.finish_reason() == "abort"
        assert 3.0 <= elapsed < 3.0 + 5.0, elapsed
        assert len(long.events) < 240  # it really was cut


def test_drain_returns_as_soon_as_the_streams_are_done(slow_app):
    app, host = slow_app
    with serve(app) as url:
        (stream,) = start_streams(url, 16)  # ~0.8 s of steps
        started = time.monotonic()
        draining = asyncio.run_coroutine_threadsafe(drain_app(app, 30.0), host._loop)  # noqa: SLF001
        assert draining.result(timeout=30) is True
        assert time.monotonic() - started < 10
        stream.join(timeout=10)
        assert stream.finish_reason() == "length"


def test_a_second_signal_ends_the_wait(slow_app):
    app, host = slow_app
    with serve(app) as url:
        (stream,) = start_streams(url, 240)  # >= 12 s of steps
        started = time.monotonic()
        draining = asyncio.run_coroutine_threadsafe(drain_app(app, 60.0), host._loop)  # noqa: SLF001
        time.sleep(0.5)
        host._loop.call_soon_threadsafe(app.state.qserve.drain.cut)  # noqa: SLF001 - what SIGTERM #2 does
        assert draining.result(timeout=20) is False
        assert time.monotonic() - started < 10
        stream.join(timeout=10)
        assert stream.finish_reason() == "abort"


def test_sigterm_exits_within_the_one_budget_even_with_a_stuck_request(checkpoints):
    """Issue 31: SIGTERM exited 32.5 s after the signal with --shutdown-timeout 25 (drain, then a
    5 s flush, then uvicorn's own 10 s, then the interpreter joining worker threads). The budget
    now covers all of it; a request stuck in a worker thread cannot hold the process past it."""
    import signal
    import threading

    import uvicorn

    from qserve.server.draining_server import DrainingServer, shutdown_plan

    plan = shutdown_plan(25.0)
    assert plan.wait_s == 20.0 and plan.wait_s + plan.flush_s + plan.close_s <= plan.total_s == 25.0
    host = AsyncEngine(build_engines([ModelSpec("llama", checkpoints["llama"])], host_config()))
    app = create_app(host, log_stats=False, log_requests=False)
    release = threading.Event()

    @app.post("/stuck")
    async def stuck() -> dict:
        await asyncio.to_thread(release.wait, 60)  # ignores the engine's abort
        return {}

    exits: list[float] = []
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=10)
    server = DrainingServer(config, app, shutdown_timeout=2.0, exit_process=lambda code: exits.append(time.monotonic()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started, timeout=30)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        threading.Thread(target=lambda: httpx.post(f"{url}/stuck", timeout=30), daemon=True).start()
        assert wait_for(lambda: app.state.qserve.drain.in_flight == 1, timeout=10)
        signalled = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        assert wait_for(lambda: exits, timeout=20)
        # the 2 s deadline, not uvicorn's 10 s graceful timeout; 1 s of slack for a loaded CI machine
        assert exits[0] - signalled <= 2.0 + 1.0, exits[0] - signalled
    finally:
        release.set()
        thread.join(timeout=30)
