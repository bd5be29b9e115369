"""The ``/v1/chat/completions`` route (OpenAI's chat completions API).

Knows: the path and its body model (``ChatCompletionRequest``), that a model's sampling
defaults fill what the request leaves out, and that the work runs through ``OpenAIServing``.
Must not know: chat templates, tool parsing (``serving``, ``tools``), the API key (``app``
applies it).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from qserve.server.protocol import ChatCompletionRequest
from qserve.server.route_support import app_state, respond, serving, tenant_of
from qserve.server.serving import OpenAIServing

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    s: OpenAIServing = Depends(serving),  # noqa: B008
) -> Any:
    await s.refresh_lora_models(body.model)  # an adapter loaded elsewhere: its base's defaults below
    app_state(request).apply_sampling_defaults(body)
    return await respond(request, s.create_chat_completion(body, **tenant_of(request)))
