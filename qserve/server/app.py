"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, health, metrics, lifespan.

Knows: the HTTP surface (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``), how errors of every kind (pydantic validation, ``ServingError``,
unknown routes, bugs) become OpenAI's ``{"error": {...}}`` body, how a client disconnect
cancels its request, and the app's lifetime (load models in the background so ``/health``
answers 503 while loading; start and stop the ``AsyncEngine``). Must not know: how requests
become engine inputs (``serving``), how engines are stepped (``AsyncEngine``).

``create_app(host)`` serves an ``AsyncEngine`` that already exists; ``create_app(
host_factory=...)`` builds it in a worker thread after the server is up.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from qserve.engine.async_engine import AsyncEngine
from qserve.server.metrics import CONTENT_TYPE, ServerMetrics
from qserve.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse
from qserve.server.serving import OpenAIServing, ServingError
from qserve.server.tenancy import TenantGate
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

    def __init__(self, api_key: str | None, tenants: Tenants | None = None) -> None:
        self.api_key = api_key
        self.host: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.load_error: str | None = None
        self.metrics = ServerMetrics(lambda: self.host)
        # Tenants (API key -> tenant, admission, per-tenant metrics); None: no tenants.
        self.tenants = tenants
        self.tenant_gate = TenantGate(tenants, self.metrics.registry) if tenants is not None else None

    def attach(self, host: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        host.listener = self.metrics
        if self.tenants is not None:  # the schedulers share seats by tenant weight
            for hosted in host.models.values():
                hosted.engine.scheduler.set_tenants(self.tenants.weights, self.tenants.max_running)
        host.start(loop)
        self.serving = OpenAIServing(host, self.tenant_gate)
        self.host = host

    @property
    def ready(self) -> bool:
        return self.host is not None and self.serving is not None and self.host.is_running


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=_STATUS_TYPES.get(status, "Error"), param=param, code=status)
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
    tenants: Tenants | None = None,
) -> FastAPI:
    if (host is None) == (host_factory is None):
        raise ValueError("create_app: give exactly one of host or host_factory")
    state = AppState(api_key, tenants)

    async def load(loop: asyncio.AbstractEventLoop) -> None:
        assert host_factory is not None
        try:
            built = await asyncio.to_thread(host_factory)
            state.attach(built, loop)
            logger.info("models ready: %s", ", ".join(built.model_names))
        except Exception as err:  # noqa: BLE001 - reported through /health and the callback
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
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
            if state.host is not None:
                await asyncio.to_thread(state.host.shutdown)
                logger.info("engine stopped; outstanding requests aborted")

    app = FastAPI(title="qserve", lifespan=lifespan)
    app.state.qserve = state

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ServingError)
    async def _serving_error(_: Request, err: ServingError) -> JSONResponse:
        return JSONResponse(err.to_response().model_dump(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        loc = [x for x in first.get("loc", ()) if x != "body"]
        param = ".".join(str(x) for x in loc) if loc and isinstance(loc[0], str) else None
        message = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}" for e in errors
        )
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
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if (
            state.api_key is None  # tenants only: the key matched none of theirs
            or scheme.lower() != "bearer"
            or not secrets.compare_digest(token.strip().encode(), state.api_key.encode())
        ):
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
        return await _respond(request, s.create_completion(body, **_tenant_of(request)))

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        s: OpenAIServing = Depends(serving),  # noqa: B008
    ) -> Any:
        return await _respond(request, s.create_chat_completion(body, **_tenant_of(request)))

    return app


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
