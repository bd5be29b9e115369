"""The ``/v1/completions`` route (OpenAI's legacy completions API).

Knows: the path and its body model (``CompletionRequest``), that a model's sampling defaults
fill what the request leaves out, and that the work runs through ``OpenAIServing``. Must not
know: how the request becomes engine inputs (``serving``), the API key (``app`` applies it).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from qserve.server.protocol import CompletionRequest
from qserve.server.route_support import app_state, respond, serving, tenant_of
from qserve.server.serving import OpenAIServing

router = APIRouter()


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest,
    request: Request,
    s: OpenAIServing = Depends(serving),  # noqa: B008
) -> Any:
    await s.refresh_lora_models(body.model)  # an adapter loaded elsewhere: its base's defaults below
    app_state(request).apply_sampling_defaults(body)
    return await respond(request, s.create_completion(body, **tenant_of(request)))
