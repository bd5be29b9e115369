"""An unexpected exception in a route becomes a 500 that keeps the connection usable.

Knows: the ASGI message order (a response starts once) and how uvicorn treats an exception
that reaches it: Starlette's ``ServerErrorMiddleware`` sends the 500 built by the app's
``Exception`` handler and then raises again, and uvicorn, seeing a response already sent,
closes the connection, so the client's next request on that keep-alive connection is reset
(the 2026-12-05 audit: every 500 cost the following request). Here the exception is caught
inside the app, answered, and not raised further. Must not know: routes, engines, the shape
of the error body (``respond`` builds it).

An exception after the response has started (a broken stream) is raised on: nothing can be
answered any more, and closing the connection is then the honest end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class InternalErrors:
    """ASGI middleware; ``respond(err)`` returns the ASGI app that sends the 500."""

    def __init__(self, app: ASGIApp, respond: Callable[[Exception], ASGIApp]) -> None:
        self.app = app
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            if started:
                raise
            logger.exception("unhandled error")
            await self.respond(err)(scope, receive, send)
