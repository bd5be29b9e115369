"""Cross-origin requests (CORS), as vLLM's ``--allowed-origins`` / ``--allowed-methods`` /
``--allowed-headers`` / ``--allow-credentials`` configure them.

Knows: the four settings and vLLM's defaults (any origin, method and header; no
credentials), and where Starlette's ``CORSMiddleware`` goes: outside the guard, so a
browser's preflight ``OPTIONS`` (which never carries the API key) is answered, and error
responses (401, 413, 503) carry the CORS headers a page needs to read them. Must not know:
routes, the API key, engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsConfig:
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def add_cors(app: FastAPI, config: CorsConfig) -> None:
    """Add the middleware; call it after the other middleware so it is the outermost one."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
    )
