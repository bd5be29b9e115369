"""Graceful shutdown ("drain"): stop taking work, let what runs finish, then end the rest cleanly.

Knows: which requests are in flight (``DrainMiddleware`` counts every HTTP request except
the probes), the draining flag (new requests get 503 with ``Connection: close``; ``/health``
reads the flag), and the drain sequence: wait up to a timeout for the in-flight requests to
end; past it, ask the caller to abort what remains (the engine then ends every stream with
``finish_reason: "abort"`` and ``[DONE]``) and wait briefly for those last chunks to go out.
Must not know: signals or uvicorn (``qserve.commands.serve`` wires SIGTERM to ``drain``),
engines, routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

# Answered while draining and not counted as in flight: load balancers keep polling them.
PROBE_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
FLUSH_TIMEOUT_S = 5.0  # after aborting: time for the final chunks to reach the clients
POLL_S = 0.05


class DrainState:
    """In-flight count and the draining flag of one app (loop thread only)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._cut = False

    def cut(self) -> None:
        """End the wait now, as if the timeout had passed (a second signal while draining)."""
        self._cut = True

    async def _wait_idle(self, timeout_s: float, *, cuttable: bool = True) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0:
            if time.monotonic() >= deadline or (cuttable and self._cut):
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def drain(
        self, timeout_s: float, abort_all: Callable[[], Awaitable[None]], flush_s: float = FLUSH_TIMEOUT_S
    ) -> bool:
        """Refuse new requests, wait up to ``timeout_s`` for the in-flight ones, then abort the
        rest through ``abort_all`` and let their final chunks go out, both within ``flush_s``
        (a request that ignores the abort, e.g. one waiting on a worker thread, is left to the
        server's own shutdown). True if nothing was cut."""
        self.draining = True
        logger.info("draining: %d request(s) in flight; waiting up to %.0f s", self.in_flight, timeout_s)
        if await self._wait_idle(timeout_s):
            logger.info("drained: every request finished")
            return True
        logger.warning(
            "%s: ending %d request(s) with finish_reason 'abort'",
            "asked to stop now" if self._cut else f"shutdown timeout ({timeout_s:.0f} s) reached",
            self.in_flight,
        )
        flush_deadline = time.monotonic() + flush_s
        try:  # stopping the engine joins its step thread: bounded, like the rest
            await asyncio.wait_for(abort_all(), timeout=flush_s)
        except asyncio.TimeoutError:
            logger.warning("the engine did not stop within %.1f s; shutting down anyway", flush_s)
        if not await self._wait_idle(max(flush_deadline - time.monotonic(), 0.0), cuttable=False):
            logger.warning("%d request(s) still open after aborting; closing anyway", self.in_flight)
        return False


_REFUSED = json.dumps(
    {
        "error": {
            "message": "the server is shutting down; retry on another replica",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
).encode()


class DrainMiddleware:
    """Pure ASGI middleware: counts in-flight requests; while draining, refuses new ones (503)."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(_REFUSED)).encode()),
                        (b"connection", b"close"),
                        (b"retry-after", b"1"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": _REFUSED})
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
