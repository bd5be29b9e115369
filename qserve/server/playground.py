"""The browser side of the server: the playground page at ``/``, its live pool endpoint, and
FastAPI's ``/docs`` / ``/redoc`` served from local assets.

Knows: where the playground's static files live (``qserve/server/ui/``, shipped in the
package), the small JSON document the page polls (``GET /ui/stats``: per model, KV pages held
in the shared pool, running and waiting requests, generated tokens per second), and where the
Swagger UI / ReDoc bundles come from (the ``fastapi-offline`` package ships them, so nothing is
fetched from a CDN). Must not know: how requests are served or engines stepped; it reads
``AsyncEngine.stats()`` and the Prometheus registry like a scraper would.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).parent / "ui"
RATE_WINDOW_S = 3.0  # tok/s is measured over (about) the last few seconds of polls


def _docs_assets() -> Path | None:
    try:
        import fastapi_offline
    except ImportError:
        return None
    path = Path(fastapi_offline.__file__).parent / "static"
    return path if (path / "swagger-ui-bundle.js").is_file() else None


def declare_bearer_auth(app: FastAPI) -> None:
    """``Authorization: Bearer <key>`` as the OpenAPI schema's security scheme, for every route."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()  # FastAPI caches it; adding the scheme again changes nothing
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes["bearerAuth"] = {"type": "http", "scheme": "bearer", "description": "--api-key or a tenant's key"}
        schema["security"] = [{"bearerAuth": []}]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def add_offline_docs(app: FastAPI) -> None:
    """``/docs`` and ``/redoc`` with their JavaScript and CSS served by this server; the schema
    declares the bearer key, so Swagger UI's "Authorize" button sends it."""
    declare_bearer_auth(app)
    assets = _docs_assets()
    if assets is None:
        return  # no local bundle: no docs pages rather than pages that call a CDN
    app.mount("/_docs_static", StaticFiles(directory=assets), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API docs",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_js_url="/_docs_static/swagger-ui-bundle.js",
            swagger_css_url="/_docs_static/swagger-ui.css",
            swagger_favicon_url="/_docs_static/favicon.png",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - ReDoc",
            redoc_js_url="/_docs_static/redoc.standalone.js",
            redoc_favicon_url="/_docs_static/favicon.png",
            with_google_fonts=False,
        )


class ThroughputMeter:
    """Generated tokens per second per model, from the ``vllm:generation_tokens`` counter as
    read at each poll (a sliding window of samples; no per-token work)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def rate(self, model: str, total_tokens: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        samples = self._samples.setdefault(model, deque())
        samples.append((now, total_tokens))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()  # keep one sample at least window_s old
        first_t, first_n = samples[0]
        return (total_tokens - first_n) / (now - first_t) if now > first_t else 0.0


def add_playground(app: FastAPI, state: Any) -> None:
    """``/`` (the page), ``/ui/static/*`` (its assets) and ``/ui/stats`` (what it polls)."""
    meter = ThroughputMeter()
    app.mount("/ui/static", StaticFiles(directory=UI_DIR), name="ui-static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(UI_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/ui/stats", include_in_schema=False)
    async def stats() -> JSONResponse:
        host = state.host
        models = []
        if host is not None:
            generated = state.metrics.totals("vllm:generation_tokens_total")  # every API server process's
            for name, numbers in host.stats().items():
                total = generated.get(name, 0.0)
                models.append(
                    {
                        "name": name,
                        "pages_used": numbers["pool_pages_used"],
                        "pages_total": numbers["pool_pages_total"],
                        "pages_free": numbers["pool_pages_free"],
                        "running": numbers["num_running"],
                        "waiting": numbers["num_waiting"],
                        "generated_tokens": int(total),
                        "tokens_per_s": round(meter.rate(name, total), 2),
                    }
                )
        return JSONResponse(
            {"ready": bool(state.ready), "loading_error": state.load_error, "models": models},
            headers={"Cache-Control": "no-store"},
        )
