"""The FastAPI app: which API surfaces it serves, the API-key check, OpenAI-shaped errors, lifespan.

Knows: the API surfaces, each a module with its own ``router`` (``completions``, ``chat``,
``models``, ``tokenize``, ``responses``, ``embeddings``, and ``lora_routes`` when runtime LoRA
updates are allowed: behind the API key; ``admin``: ``/health``, ``/ping``, ``/version``,
``/metrics``, open or gated by the guard middleware), the middleware (``X-Request-Id``; the
drain's in-flight count and 503s), how errors of every kind (pydantic validation,
``ServingError``, unknown routes, bugs) become OpenAI's ``{"error": {...}}`` body, and the
app's lifetime (load models in the background so ``/health`` answers 503 while loading; start
and stop the ``AsyncEngine``). Must not know: what a route does (its surface's module), how
requests become engine inputs (``serving``), how engines are stepped (``AsyncEngine``).

``create_app(host)`` serves an ``AsyncEngine`` that already exists; ``create_app(
host_factory=...)`` builds it in a worker thread after the server is up. ``drain_app`` is
the graceful shutdown (SIGTERM).

One API server of several (``api_server_index``; ``qserve serve --api-server-count N``): every
answer names its process's index (``X-Qserve-Api-Server``), metrics are summed over the processes
(``metrics_dir``), stored responses live in a file they share (``responses_db``), and only the
first process logs the periodic stats line (from the summed token counts).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qserve.engine.async_engine import AsyncEngine, EngineDeadError
from qserve.server import admin, chat, completions, lora_routes, models, route_support, tokenize
from qserve.server.app_state import AppState
from qserve.server.body_gate import BodyGate
from qserve.server.cors import CorsConfig, add_cors
from qserve.server.drain import FLUSH_TIMEOUT_S, DrainMiddleware
from qserve.server.embeddings import add_embedding_routes
from qserve.server.guard import DEFAULT_MAX_REQUEST_BYTES, GuardConfig, RequestGuard
from qserve.server.internal_errors import InternalErrors
from qserve.server.metrics import AggregatedTokenCounts
from qserve.server.playground import add_offline_docs, add_playground
from qserve.server.protocol import ErrorInfo, ErrorResponse
from qserve.server.request_context import RequestIdMiddleware
from qserve.server.request_limits import clip
from qserve.server.request_log import STATS_INTERVAL_S, StatsLogger
from qserve.server.responses import add_responses_routes
from qserve.server.security_headers import SecurityHeaders
from qserve.server.serving import ServingError
from qserve.server.tenancy import resolve_tenant
from qserve.tenants import Tenants

logger = logging.getLogger(__name__)

# The API surfaces: one module each, exposing ``router`` (a FastAPI ``APIRouter``). A new
# surface (e.g. ``responses``, ``embeddings``) is one import and one entry here.
KEYED_ROUTERS: tuple[APIRouter, ...] = (models.router, completions.router, chat.router, tokenize.router)
OPEN_ROUTERS: tuple[APIRouter, ...] = (admin.router,)  # no key dependency (the guard gates /metrics)

_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


MAX_ERROR_MESSAGE_CHARS = 1000  # error messages never echo unbounded input


def _safe(text: str | None, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str | None:
    """Error text that is bounded and always encodable (a lone surrogate in a message made
    the error response itself fail: a 500 and a broken keep-alive connection)."""
    return None if text is None else clip(text, limit)


def _validation_message(error: dict[str, Any]) -> str:
    if error.get("type") == "extra_forbidden":  # a field we do not implement: say so, never ignore it
        return "unsupported field: qserve does not implement it"
    return str(error.get("msg"))


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    type: str | None = None,  # noqa: A002 - OpenAI's field name
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(
            message=_safe(message) or "",
            type=type or _STATUS_TYPES.get(status, "Error"),
            param=_safe(param, 200),
            code=status,
        )
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def create_app(
    host: AsyncEngine | None = None,
    *,
    host_factory: Callable[[], AsyncEngine] | None = None,
    api_key: str | None = None,
    on_load_failed: Callable[[BaseException], None] | None = None,
    on_ready: Callable[[AsyncEngine], None] | None = None,
    allowed_hosts: Collection[str] | None = None,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    metrics_without_key: bool = False,
    log_requests: bool = True,
    log_stats: bool = True,
    stats_interval_s: float = STATS_INTERVAL_S,
    ui: bool = True,
    tool_call_parser: str | None = None,
    tenants: Tenants | None = None,
    cors: CorsConfig | None = None,
    api_server_index: int | None = None,
    metrics_dir: str | None = None,
    responses_db: str | None = None,
) -> FastAPI:
    """``allowed_hosts``: names the ``Host`` header may carry (None: any). ``max_request_bytes``:
    bodies above it get 413 before they are read (None: no limit). With ``api_key`` every route
    but ``/health`` and ``/ping`` needs it (``/metrics`` too unless ``metrics_without_key``).
    ``log_requests`` / ``log_stats``: the per-request log line and the periodic stats line
    (``qserve.server.request_log``). ``cors``: cross-origin settings (None: no CORS headers).
    ``api_server_index``, ``metrics_dir``, ``responses_db``: one API server process of several
    (the module doc). Shut down gracefully with ``drain_app``."""
    if (host is None) == (host_factory is None):
        raise ValueError("create_app: give exactly one of host or host_factory")
    state = AppState(api_key, tenants, log_requests=log_requests, metrics_dir=metrics_dir)
    state.tool_call_parser = tool_call_parser
    token_counts = AggregatedTokenCounts(state.metrics) if metrics_dir is not None else state.request_log
    log_stats = log_stats and api_server_index in (None, 0)  # one stats line for all the processes
    store = None
    if responses_db is not None:
        from qserve.server.shared_response_store import SharedResponseStore

        store = SharedResponseStore(responses_db)

    async def load(loop: asyncio.AbstractEventLoop) -> None:
        assert host_factory is not None
        try:
            built = await asyncio.to_thread(host_factory)
            state.attach(built, loop)
            logger.info("models ready: %s", ", ".join(built.model_names))
            if on_ready is not None:
                on_ready(built)
        except Exception as err:  # noqa: BLE001 - reported through /health and the callback
            if on_load_failed is not None and isinstance(err, (ValueError, FileNotFoundError)):
                # A user error (a broken checkpoint): the callback's owner reports it in one line.
                logger.debug("loading the models failed", exc_info=True)
            else:
                logger.exception("loading the models failed")
            state.load_error = str(err)
            if on_load_failed is not None:
                on_load_failed(err)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        loading = None
        if host is not None:
            state.attach(host, loop)
        else:
            loading = asyncio.create_task(load(loop))
        stats_task = None
        if log_stats:
            stats_task = asyncio.create_task(StatsLogger(lambda: state.host, token_counts, stats_interval_s).run())
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            if loading is not None and not loading.done():
                loading.cancel()
            if state.serving is not None:
                state.serving.close()  # running grammar compiles are killed, never waited on
            if state.host is not None:
                await asyncio.to_thread(state.host.shutdown)
                logger.info("engine stopped; outstanding requests aborted")

    # /docs from assets shipped in a package (no CDN); ReDoc likewise.
    app = FastAPI(title="qserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.qserve = state
    add_offline_docs(app)
    if ui:
        add_playground(app, state)

    # ------------------------------------------------------------------ the gate (hardening)
    def authorized(header: str) -> bool:
        if state.tenants is not None:  # a tenant's key passes; with tenants a key is always needed
            scheme, _, token = header.partition(" ")
            if scheme.lower() == "bearer" and token.strip() and state.tenants.tenant_for_key(token.strip()):
                return True
            if state.api_key is None:
                return False
        return _bearer_matches(header, state.api_key)

    # Innermost: a route's unexpected exception is answered here (500) without closing the connection.
    app.add_middleware(InternalErrors, respond=lambda err: error_response(500, f"internal error: {type(err).__name__}"))
    # Inside the guard (key and size first): caps on what a large JSON body holds, counted off the loop.
    app.add_middleware(BodyGate, respond=lambda status, message, param: error_response(status, message, param))
    app.add_middleware(
        RequestGuard,
        config=GuardConfig(
            authorized=authorized if (api_key is not None or tenants is not None) else None,
            allowed_hosts=allowed_hosts,
            max_request_bytes=max_request_bytes,
            metrics_without_key=metrics_without_key,
        ),
        respond=lambda status, message, headers: error_response(status, message, headers=headers),
    )

    # Outermost last: X-Request-Id is set (and echoed) even on a drain's 503.
    app.add_middleware(DrainMiddleware, state=state.drain)
    app.add_middleware(SecurityHeaders)  # on every answer, refusals included
    app.add_middleware(RequestIdMiddleware)
    if api_server_index is not None:  # which of the API server processes answered
        app.add_middleware(ApiServerHeader, index=api_server_index)
    if cors is not None:  # outermost: a preflight carries no key, and errors need the CORS headers
        add_cors(app, cors)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ServingError)
    async def _serving_error(_: Request, err: ServingError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, headers=err.headers, type=err.type)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, err: EngineDeadError) -> JSONResponse:  # e.g. the engine core died
        return error_response(503, str(err) or "the engine is not running", type="ServiceUnavailableError")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        loc = [x for x in first.get("loc", ()) if x != "body"]
        param = ".".join(str(x) for x in loc) if loc and isinstance(loc[0], str) else None
        message = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {_validation_message(e)}"
            for e in errors[:5]
        )
        if len(errors) > 5:
            message += f"; and {len(errors) - 5} more errors"
        return error_response(400, message or "invalid request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(err).__name__}")

    # ------------------------------------------------------------------ dependencies
    async def require_api_key(request: Request) -> None:
        if state.tenants is not None and resolve_tenant(state.tenants, request):
            return  # a tenant's key; with tenants, --api-key (if any) is a key without a tenant
        if state.api_key is None and state.tenants is None:
            return
        if state.api_key is None or not _bearer_matches(request.headers.get("authorization", ""), state.api_key):
            raise ServingError(
                401, "Invalid or missing API key (Authorization: Bearer <key>)", type="AuthenticationError"
            )

    # ------------------------------------------------------------------ routes (one module per API surface)
    for router in OPEN_ROUTERS:
        app.include_router(router)
    for router in KEYED_ROUTERS:
        app.include_router(router, dependencies=[Depends(require_api_key)])
    if lora_routes.runtime_updates_allowed():  # vLLM's switch: the adapter routes exist only then
        app.include_router(lora_routes.router, dependencies=[Depends(require_api_key)])
    # The Responses and Embeddings surfaces register themselves (their own modules).
    api = dict(require_api_key=require_api_key, serving=route_support.serving, respond=route_support.respond,
               tenant_of=route_support.tenant_of)  # fmt: skip
    add_embedding_routes(app, **api)
    add_responses_routes(app, apply_defaults=state.apply_sampling_defaults, store=store, **api)  # type: ignore[arg-type]

    return app


API_SERVER_HEADER = b"x-qserve-api-server"


class ApiServerHeader:
    """Pure ASGI middleware: ``X-Qserve-Api-Server: <index>`` on every answer of one API server
    process of several (which one served a request; the index, never the pid)."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self._value = str(index).encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (API_SERVER_HEADER, self._value)]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def _bearer_matches(header: str, api_key: str | None) -> bool:
    """``Authorization: Bearer <key>`` with the right key (constant-time compare)."""
    if api_key is None:
        return True
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


async def drain_app(app: FastAPI, timeout_s: float, flush_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Graceful shutdown of an app from ``create_app``: new requests get 503 and ``/health``
    503 at once; in-flight requests get up to ``timeout_s`` seconds to finish; then the engine
    is stopped, which ends every remaining stream with ``finish_reason: "abort"`` and ``[DONE]``
    (stopping it and flushing those last chunks take at most ``flush_s`` more).
    Returns True if every request finished by itself. Call it on the app's event loop."""
    state: AppState = app.state.qserve

    async def abort_all() -> None:
        if state.serving is not None:
            state.serving.close()
        if state.host is not None:
            await asyncio.to_thread(state.host.shutdown)

    return await state.drain.drain(timeout_s, abort_all, flush_s)
