"""uvicorn with a graceful drain on SIGTERM, the way orchestrators stop a worker.

Knows: uvicorn's signal hook (``Server.handle_exit``) and how to run ``drain_app`` on the
server's loop before uvicorn's own shutdown. The first SIGTERM drains for
``shutdown_timeout`` seconds (503 to new requests and ``/health``; in-flight requests may
finish; the rest end with finish_reason 'abort' and ``[DONE]``); the process then exits 0,
because the signal was handled (uvicorn would otherwise re-raise it after shutting down).
The first Ctrl-C drains without waiting. A second signal while draining ends the wait at
once (what still runs ends with 'abort', as at the deadline); a third is uvicorn's forced exit.

One budget: ``shutdown_timeout`` is the whole time from the first SIGTERM to the process's exit
(Kubernetes kills at 30 s; the default is 25). In-flight requests get all of it but a reserve
(a fifth, at most 5 s); the reserve ends the remaining streams and stops the engine (``flush``),
lets uvicorn close its connections (``close``) and exits. A watchdog ends the process at the
deadline whatever still runs (a request waiting on a worker thread ignores the abort, and the
interpreter's exit joins such threads: before, SIGTERM exited 32.5 s after the signal, or never).
Must not know: routes, engines (``drain_app`` does the work).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from qserve.server.app import drain_app

logger = logging.getLogger(__name__)

RESERVE_SHARE = 0.2  # of the budget, kept back from the drain wait for the steps after it
RESERVE_MAX_S = 5.0


@dataclass(frozen=True, slots=True)
class ShutdownPlan:
    """How one shutdown budget is spent, in order; the watchdog fires at ``total_s``."""

    wait_s: float  # in-flight requests may finish
    flush_s: float  # abort the rest, stop the engine, send the final chunks
    close_s: float  # uvicorn closes its connections (its timeout_graceful_shutdown)
    total_s: float


def shutdown_plan(total_s: float, wait: bool = True) -> ShutdownPlan:
    """``total_s`` split; ``wait=False`` (Ctrl-C): no waiting, only the reserve."""
    reserve = min(RESERVE_MAX_S, total_s * RESERVE_SHARE)
    wait_s = total_s - reserve if wait else 0.0
    return ShutdownPlan(wait_s, 0.4 * reserve, 0.4 * reserve, wait_s + reserve)


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        app: Any,
        shutdown_timeout: float,
        exit_process: Callable[[int], None] = os._exit,
    ) -> None:
        super().__init__(config)
        self._app = app
        self.shutdown_timeout = shutdown_timeout
        self._exit_process = exit_process
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._cut_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    def run(self, sockets: Any = None) -> None:
        super().run(sockets)
        if self._drain_requested:  # stopped by a signal: the engine is down, the clients are answered
            # Exit now: the interpreter's own teardown (torch, joining worker threads) took over a
            # second more, and forever with a thread stuck in a worker's call.
            self._flush_and_exit("drained; exiting")

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.should_exit or self._cut_requested:
            super().handle_exit(sig, frame)  # not serving yet, drained already, or a third signal
            return
        if self._drain_requested:  # a second signal: stop waiting for the in-flight requests
            self._cut_requested = True
            self._loop.call_soon_threadsafe(self._app.state.qserve.drain.cut)
            return
        self._drain_requested = True
        plan = shutdown_plan(self.shutdown_timeout, wait=sig == signal.SIGTERM)
        watchdog = threading.Timer(plan.total_s, self._out_of_time, args=(plan.total_s,))
        watchdog.daemon = True
        watchdog.start()
        # A signal handler runs between two bytecodes of the loop's own thread: hand over safely.
        self._loop.call_soon_threadsafe(self._start_drain, plan)

    def _start_drain(self, plan: ShutdownPlan) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(plan))

    async def _drain(self, plan: ShutdownPlan) -> None:
        try:
            await drain_app(self._app, plan.wait_s, plan.flush_s)
        except Exception:  # noqa: BLE001 - shut down anyway
            logger.exception("draining failed")
        finally:
            self.config.timeout_graceful_shutdown = plan.close_s  # uvicorn reads it when it shuts down
            self.should_exit = True

    def _out_of_time(self, total_s: float) -> None:
        logger.warning("shutdown budget (--shutdown-timeout %.0f s) spent: exiting now", total_s)
        self._flush_and_exit(None)

    def _flush_and_exit(self, message: str | None) -> None:
        if message:
            logger.info(message)
        for handler in logging.getLogger().handlers:
            handler.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self._exit_process(0)
