"""What every API surface's routes share: the app's state, the ready check, the tenant of a
request, and how a result (a response or an SSE stream) is sent while a client disconnect
cancels the work.

Knows: FastAPI's ``Request`` (the app's ``AppState`` lives at ``request.app.state.qserve``),
how an SSE body is always closed, how a disconnect is noticed. Must not know: any route's
path or body, the API key (``app`` applies it when it includes a surface's router),
engines, metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from qserve.server.app_state import AppState
from qserve.server.serving import OpenAIServing, ServingError

T = TypeVar("T")


def app_state(request: Request) -> AppState:
    """The ``AppState`` of the app serving ``request``."""
    return request.app.state.qserve


def serving(request: Request) -> OpenAIServing:
    """Dependency: the ``OpenAIServing`` of a ready server; 503 (Retry-After) while loading."""
    state = app_state(request)
    if not state.ready or state.serving is None:
        message = state.not_ready_reason or "the server is still loading its models"
        raise ServingError(503, message, type="ServiceUnavailableError", headers={"Retry-After": "1"})
    return state.serving


def tenant_of(request: Request) -> dict[str, str]:
    """``{"tenant": name}`` when the API-key check resolved a tenant, else ``{}``."""
    tenant = getattr(request.state, "tenant", None)
    return {"tenant": tenant} if tenant is not None else {}


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed, even when the client goes away
    mid-stream (closing it aborts the engine request and frees its pages)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; cancel it (aborting its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def respond(request: Request, work: Awaitable[Any]) -> Any:
    """The response of ``work``: its result, an SSE stream, or 499 if the client left first."""
    result = await unless_disconnected(request, work)
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    if isinstance(result, AsyncIterator):
        return SSEResponse(result, headers={"Cache-Control": "no-cache"})
    return result
