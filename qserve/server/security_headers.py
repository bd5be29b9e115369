"""Browser security headers on every answer: what a page may load and who may frame it.

Knows: which headers browsers act on (``X-Content-Type-Options: nosniff`` on every answer, so a
JSON body is never run as a script or page; on HTML, ``Content-Security-Policy`` and
``X-Frame-Options: DENY`` against injection and clickjacking), and the two kinds of HTML this
server sends: the playground (its script and styles are files of this origin, nothing inline)
and the Swagger UI / ReDoc pages (FastAPI writes a small inline bootstrap script). Must not know:
routes' logic, keys, engines.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The playground: everything from this origin, nothing inline, no framing.
PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# /docs and /redoc: FastAPI's inline bootstrap script and Swagger UI's inline styles; still this
# origin only (the bundles are served locally), no framing.
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)
DOCS_PATHS = ("/docs", "/redoc")


class SecurityHeaders:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("X-Content-Type-Options", "nosniff")
                if headers.get("content-type", "").startswith("text/html"):
                    csp = DOCS_CSP if path.startswith(DOCS_PATHS) else PAGE_CSP
                    headers.setdefault("Content-Security-Policy", csp)
                    headers.setdefault("X-Frame-Options", "DENY")
            await send(message)

        await self.app(scope, receive, send_with_headers)
