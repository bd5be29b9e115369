"""The gate in front of every route: Host header, API key and request body size, checked before
the body is read.

Knows: HTTP headers (``Host``, ``Authorization``, ``Content-Length``), which paths stay open
without a key, and the ASGI protocol well enough to refuse a request before reading its body
and to replay a body it has read. Must not know: routes' logic, engines, OpenAI shapes beyond
the error body (``respond`` builds it).

Why an ASGI middleware and not a FastAPI dependency: dependencies run after the body has been
read and parsed (a 196 MB body was read before the 401 of a missing key), and they only cover
the routes that declare them (``/metrics``, ``/docs`` and ``/openapi.json`` stayed open).

Order: Host (DNS rebinding: a web page must not drive a server on localhost through a name it
controls), then the key, then the body size (``Content-Length`` first; a streamed body is
counted as it arrives and refused as soon as it passes the limit).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # 16 MiB: far above any prompt a context can hold
# Liveness probes never need the key; nor does /version, which tells only the version string and
# is how the SGLang gateway recognises a vLLM-compatible backend before it polls its load.
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
# The playground's page and static files hold no data (its requests and its /ui/stats poll carry the
# key the user types into it), so a browser can open it on a server that has a key.
# The API docs hold no secrets either (vLLM leaves them open too): a browser opens /docs on a keyed
# server, and Swagger UI's "Authorize" button sends the key on the requests it tries.
OPEN_PAGE_PATHS = frozenset({"/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
OPEN_PREFIXES = ("/ui/static/", "/_docs_static/")
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})

# respond(status, message, headers) -> an ASGI app that sends the error body
Responder = Callable[[int, str, dict[str, str] | None], ASGIApp]


@dataclass(frozen=True)
class GuardConfig:
    """What the gate checks. ``authorized`` is None when no key is configured."""

    authorized: Callable[[str], bool] | None = None  # the Authorization header -> ok?
    allowed_hosts: Collection[str] | None = None  # None or containing "*": any Host
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES
    metrics_without_key: bool = False


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """The bind host, localhost and the loopback addresses; None (any host) when bound to every
    interface, where clients use names we cannot know (pass ``--allowed-hosts`` there)."""
    if bind_host in WILDCARD_HOSTS:
        return None
    return sorted({bind_host.lower(), "localhost", "127.0.0.1", "::1"})


def host_name(host_header: str) -> str:
    """``"Example.com:8000"`` -> ``"example.com"``, ``"[::1]:8000"`` -> ``"::1"``."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


class RequestGuard:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp, config: GuardConfig, respond: Responder) -> None:
        self.app = app
        self.config = config
        self.respond = respond
        hosts = config.allowed_hosts
        self._hosts = None if hosts is None or "*" in hosts else frozenset(h.lower() for h in hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._check_headers(scope, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        limit = self.config.max_request_bytes
        if limit is None or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await self.respond(400, "invalid Content-Length header", None)(scope, receive, send)
                return
            if int(length) > limit:
                await self._too_large(scope, receive, send, limit)
                return
        body = await self._read_body(receive, limit)
        if body is None:
            await self._too_large(scope, receive, send, limit)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope, headers: Headers) -> ASGIApp | None:
        if self._hosts is not None:
            name = host_name(headers.get("host", ""))
            if name not in self._hosts:
                return self.respond(400, "Host header not allowed (see --allowed-hosts)", None)
        authorized = self.config.authorized
        path = scope.get("path", "")
        is_open = path in OPEN_PATHS or path in OPEN_PAGE_PATHS or path.startswith(OPEN_PREFIXES)
        if authorized is not None and not is_open:
            if not (path == "/metrics" and self.config.metrics_without_key):
                if not authorized(headers.get("authorization", "")):
                    return self.respond(401, "Invalid or missing API key (Authorization: Bearer <key>)", None)
        return None

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        message = f"the request body is larger than {limit} bytes (--max-request-bytes)"
        await self.respond(413, message, {"Connection": "close"})(scope, receive, send)

    @staticmethod
    async def _read_body(receive: Receive, limit: int) -> list[Message] | None:
        """The body's messages, or None as soon as it passes ``limit`` bytes."""
        messages: list[Message] = []
        total = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # disconnect: let the app see it
                return messages
            total += len(message.get("body", b""))
            if total > limit:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[Message], receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A ``receive`` that returns the body already read, then the real stream (disconnects)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
