"""uvicorn with a graceful drain on SIGTERM, the way orchestrators stop a worker.

Knows: uvicorn's signal hook (``Server.handle_exit``) and how to run ``drain_app`` on the
server's loop before uvicorn's own shutdown. The first SIGTERM drains for
``shutdown_timeout`` seconds (503 to new requests and ``/health``; in-flight requests may
finish; the rest end with finish_reason 'abort' and ``[DONE]``); the process then exits 0,
because the signal was handled (uvicorn would otherwise re-raise it after shutting down).
The first Ctrl-C drains without waiting. A second signal while draining ends the wait at
once (what still runs ends with 'abort', as at the deadline); a third is uvicorn's forced exit.
Must not know: routes, engines (``drain_app`` does the work).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

from qserve.server.app import drain_app

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._app = app
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._cut_requested = False
        self._drain_task: asyncio.Task[None] | None = None

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
        timeout = self.shutdown_timeout if sig == signal.SIGTERM else 0.0
        # A signal handler runs between two bytecodes of the loop's own thread: hand over safely.
        self._loop.call_soon_threadsafe(self._start_drain, timeout)

    def _start_drain(self, timeout: float) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        try:
            await drain_app(self._app, timeout)
        except Exception:  # noqa: BLE001 - shut down anyway
            logger.exception("draining failed")
        finally:
            self.should_exit = True
