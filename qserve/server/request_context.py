"""The HTTP request id: ``X-Request-Id`` taken from the request (or made up), echoed on the
response, and readable by whatever runs on behalf of the request (log lines).

Knows: the header, what a usable id looks like, and the ``REQUEST_ID`` context variable that
carries it (set by ``RequestIdMiddleware`` for the life of the request; the engine host runs
its per-request callbacks in the submitting request's context, so they see it too). Must not
know: routes, engines, OpenAI shapes.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
REQUEST_ID: ContextVar[str | None] = ContextVar("qserve_request_id", default=None)

# Routers and proxies send UUIDs or similar tokens; anything else (too long, spaces, control
# or non-ASCII characters) is replaced by a fresh id rather than echoed into headers and logs.
_USABLE = re.compile(r"[\x21-\x7e]{1,128}")


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when it is usable, else a new random id."""
    for name, value in headers:
        if name.lower() == HEADER:
            text = value.decode("latin-1")
            if _USABLE.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Pure ASGI middleware (streams pass through untouched): sets ``REQUEST_ID`` and adds
    ``X-Request-Id`` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope.get("headers", []))
        encoded = request_id.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, encoded)]}
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
