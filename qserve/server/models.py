"""The model routes: ``GET /v1/models`` (the list) and ``GET /v1/models/{id}`` (one card).

Knows: OpenAI's model-list and model-card shapes (``ModelList`` / ``ModelCard``) and the 404
for an unknown id. Must not know: checkpoints' paths (never shown), engines, the API key
(``app`` applies it).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from qserve.server.protocol import ModelCard
from qserve.server.route_support import serving
from qserve.server.serving import OpenAIServing, ServingError

router = APIRouter()


@router.get("/v1/models")
async def list_models(s: OpenAIServing = Depends(serving)) -> Any:  # noqa: B008
    await s.refresh_lora_models()  # the engine core's adapters now, whichever front end loaded them
    return s.list_models()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, s: OpenAIServing = Depends(serving)) -> ModelCard:  # noqa: B008
    await s.refresh_lora_models(model_id)
    for card in s.list_models().data:
        if card.id == model_id:
            return card
    served = ", ".join([*s.models, *s.lora_models])
    message = f"The model `{model_id}` does not exist. Served models: {served}."
    raise ServingError(404, message, type="NotFoundError", param="model")
