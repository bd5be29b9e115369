"""The operational routes: ``/health`` and ``/ping`` (liveness/readiness), ``/version`` and
``/metrics`` (Prometheus).

Knows: what each answers (``/health``: 200 when ready, 503 while loading, after a failed load
or while draining; ``/ping`` repeats it, as vLLM's SageMaker route does; ``/version``: the
package version, which the SGLang gateway reads to recognise a vLLM-compatible backend).
These routes take no API-key dependency: ``/health``, ``/ping`` and ``/version`` stay open,
and ``/metrics`` is gated (or not: ``--metrics-without-key``) by the ``guard`` middleware.
Must not know: OpenAI shapes, engines beyond ``AppState.ready``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from qserve import __version__
from qserve.server.metrics import CONTENT_TYPE
from qserve.server.route_support import app_state
from qserve.server.serving import ServingError
from qserve.server.tenancy import resolve_tenant, tenant_view

router = APIRouter()


class VersionResponse(BaseModel):
    version: str


@router.get("/health")
async def health(request: Request) -> Response:
    state = app_state(request)
    if state.drain.draining:
        raise ServingError(503, "shutting down", type="ServiceUnavailableError")
    if state.ready:
        return Response(status_code=200)
    raise ServingError(503, state.not_ready_reason or "loading models", type="ServiceUnavailableError")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = app_state(request)
    body = state.metrics.render()
    if state.tenants is not None and resolve_tenant(state.tenants, request):  # a tenant's key
        body = tenant_view(body, request.state.tenant)  # its own series only
    return Response(body, media_type=CONTENT_TYPE)


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> Response:
    return await health(request)
