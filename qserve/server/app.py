"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, health, metrics, lifespan.

Knows: the HTTP surface (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``; ``/v1/responses``, ``/v1/embeddings`` and the vLLM-compatible
worker routes come from ``responses``, ``embeddings`` and ``worker_api``), the
middleware (``X-Request-Id``; the drain's in-flight count and 503s), how errors of every
kind (pydantic validation, ``ServingError``, unknown routes, bugs) become OpenAI's
``{"error": {...}}`` body, how a client disconnect
cancels its request, and the app's lifetime (load models in the background so ``/health``
answers 503 while loading; start and stop the ``AsyncEngine``). Must not know: how requests
become engine inputs (``serving``), how engines are stepped (``AsyncEngine``).

``create_app(host)`` serves an ``AsyncEngine`` that already exists; ``create_app(
host_factory=...)`` builds it in a worker thread after the server is up. ``drain_app`` is
the graceful shutdown (SIGTERM).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from qserve.engine.async_engine import AsyncEngine, Listeners
from qserve.server.drain import DrainMiddleware, DrainState
from qserve.server.embeddings import add_embedding_routes
from qserve.server.generation_config import apply_sampling_defaults
from qserve.server.guard import DEFAULT_MAX_REQUEST_BYTES, GuardConfig, RequestGuard
from qserve.server.metrics import CONTENT_TYPE, ServerMetrics
from qserve.server.playground import add_offline_docs, add_playground
from qserve.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse
from qserve.server.request_context import RequestIdMiddleware
from qserve.server.request_limits import clip
from qserve.server.request_log import STATS_INTERVAL_S, RequestLog, StatsLogger
from qserve.server.responses import add_responses_routes
from qserve.server.serving import OpenAIServing, ServingError
from qserve.server.tenancy import TenantGate
from qserve.server.worker_api import add_worker_routes
from qserve.tenants import Tenants

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STATUS_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class AppState:
    """What the routes need; filled in when the models are loaded."""

    def __init__(self, api_key: str | None, tenants: Tenants | None = None, *, log_requests: bool = True) -> None:
        self.api_key = api_key
        self.host: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.load_error: str | None = None
        self.metrics = ServerMetrics(lambda: self.host)
        self.request_log = RequestLog(log_requests=log_requests)
        self.drain = DrainState()
        self.tool_call_parser: str | None = None  # None: from each model's chat template
        # Tenants (API key -> tenant, admission, per-tenant metrics); None: no tenants.
        self.tenants = tenants
        self.tenant_gate = TenantGate(tenants, self.metrics.registry) if tenants is not None else None

    def attach(self, host: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        host.listener = Listeners(self.metrics, self.request_log)
        host.start(loop)
        if self.tenants is not None:  # the schedulers share seats by tenant weight
            for hosted in host.models.values():
                hosted.engine.scheduler.set_tenants(self.tenants.weights, self.tenants.max_running)
        self.serving = OpenAIServing(host, self.tool_call_parser, tenant_gate=self.tenant_gate)
        self.host = host

    def apply_sampling_defaults(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        hosted = self.host.models.get(body.model) if self.host is not None else None
        if hosted is not None and hosted.sampling_defaults:
            apply_sampling_defaults(body, hosted.sampling_defaults)

    @property
    def ready(self) -> bool:
        return self.host is not None and self.serving is not None and self.host.is_running


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


class _SSEResponse(StreamingResponse):
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


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
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
) -> FastAPI:
    """``allowed_hosts``: names the ``Host`` header may carry (None: any). ``max_request_bytes``:
    bodies above it get 413 before they are read (None: no limit). With ``api_key`` every route
    but ``/health`` and ``/ping`` needs it (``/metrics`` too unless ``metrics_without_key``).
    ``log_requests`` / ``log_stats``: the per-request log line and the periodic stats line
    (``qserve.server.request_log``). Shut down gracefully with ``drain_app``."""
    if (host is None) == (host_factory is None):
        raise ValueError("create_app: give exactly one of host or host_factory")
    state = AppState(api_key, tenants, log_requests=log_requests)
    state.tool_call_parser = tool_call_parser

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
            stats_task = asyncio.create_task(StatsLogger(lambda: state.host, state.request_log, stats_interval_s).run())
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            if loading is not None and not loading.done():
                loading.cancel()
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
    app.add_middleware(RequestIdMiddleware)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ServingError)
    async def _serving_error(_: Request, err: ServingError) -> JSONResponse:
        return error_response(err.status, err.message, err.param, headers=err.headers, type=err.type)

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
        if state.tenants is not None and _resolve_tenant(state.tenants, request):
            return  # a tenant's key; with tenants, --api-key (if any) is a key without a tenant
        if state.api_key is None and state.tenants is None:
            return
        if state.api_key is None or not _bearer_matches(request.headers.get("authorization", ""), state.api_key):
            raise ServingError(
                401, "Invalid or missing API key (Authorization: Bearer <key>)", type="AuthenticationError"
            )

    def serving() -> OpenAIServing:
        if not state.ready or state.serving is None:
            message = state.load_error or "the server is still loading its models"
            raise ServingError(503, message, type="ServiceUnavailableError", headers={"Retry-After": "1"})
        return state.serving

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> Response:
        if state.drain.draining:
            return error_response(503, "shutting down")
        if state.ready:
            return Response(status_code=200)
        return error_response(503, state.load_error or "loading models")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models(s: OpenAIServing = Depends(serving)) -> Any:  # noqa: B008
        return s.list_models()

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(
        body: CompletionRequest,
        request: Request,
        s: OpenAIServing = Depends(serving),  # noqa: B008
    ) -> Any:
        state.apply_sampling_defaults(body)
        return await _respond(request, s.create_completion(body, **_tenant_of(request)))

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        s: OpenAIServing = Depends(serving),  # noqa: B008
    ) -> Any:
        state.apply_sampling_defaults(body)
        return await _respond(request, s.create_chat_completion(body, **_tenant_of(request)))

    api = {"require_api_key": require_api_key, "serving": serving, "respond": _respond, "tenant_of": _tenant_of}
    add_embedding_routes(app, **api)
    add_responses_routes(app, apply_defaults=state.apply_sampling_defaults, **api)

    # ------------------------------------------------------------------ vLLM-compatible worker routes
    add_worker_routes(app, health=health, require_api_key=require_api_key, serving=serving)

    return app


def _bearer_matches(header: str, api_key: str | None) -> bool:
    """``Authorization: Bearer <key>`` with the right key (constant-time compare)."""
    if api_key is None:
        return True
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


async def drain_app(app: FastAPI, timeout_s: float) -> bool:
    """Graceful shutdown of an app from ``create_app``: new requests get 503 and ``/health``
    503 at once; in-flight requests get up to ``timeout_s`` seconds to finish; then the engine
    is stopped, which ends every remaining stream with ``finish_reason: "abort"`` and ``[DONE]``.
    Returns True if every request finished by itself. Call it on the app's event loop."""
    state: AppState = app.state.qserve

    async def abort_all() -> None:
        if state.host is not None:
            await asyncio.to_thread(state.host.shutdown)

    return await state.drain.drain(timeout_s, abort_all)


def _resolve_tenant(tenants: Tenants, request: Request) -> bool:
    """Set ``request.state.tenant`` from the Bearer key if it is a tenant's."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    tenant = tenants.tenant_for_key(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
    if tenant is None:
        return False
    request.state.tenant = tenant.name
    return True


def _tenant_of(request: Request) -> dict[str, str]:
    tenant = getattr(request.state, "tenant", None)
    return {"tenant": tenant} if tenant is not None else {}


async def _respond(request: Request, work: Awaitable[Any]) -> Any:
    result = await _unless_disconnected(request, work)
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    if isinstance(result, AsyncIterator):
        return _SSEResponse(result, headers={"Cache-Control": "no-cache"})
    return result
