"""Runtime LoRA adapter routes (vLLM's): ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Knows: their JSON bodies (``{"lora_name", "lora_path"}``; ``{"lora_name"}``), vLLM's switch
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: the routes exist only when it is true, as in vLLM), its answers
(plain-text ``Success: ...``; 400 for an adapter that cannot be served, naming the field; 404 naming
an adapter that is not loaded), and which hosted model an adapter loaded at run time attaches to (the
first served with ``--enable-lora``). Must not know: how an adapter is read or applied (the engine),
the API key (``app`` applies it).
"""

from __future__ import annotations

import os

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from qserve.lora.request import LoRARequest
from qserve.server.route_support import serving
from qserve.server.serving import OpenAIServing, ServingError, bad_request

RUNTIME_UPDATE_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

router = APIRouter()


def runtime_updates_allowed() -> bool:
    """vLLM's switch: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to true (or 1)."""
    return os.environ.get(RUNTIME_UPDATE_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter of that name


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # accepted (vLLM's body); adapters are named


def _lora_base(s: OpenAIServing) -> str:
    for name, hosted in s.host.models.items():
        if getattr(hosted.engine, "lora_manager", None) is not None:
            return name
    raise bad_request("LoRA is not enabled on this server (start it with --enable-lora)", "lora_name")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, s: OpenAIServing = Depends(serving)) -> PlainTextResponse:  # noqa: B008
    name = body.lora_name
    if not name:
        raise bad_request("lora_name is empty", "lora_name")
    await s.refresh_lora_models()  # an engine core in its own process: its list, whoever changed it
    if name in s.models:
        raise bad_request(f"lora_name {name!r} is the name of a served base model", "lora_name")
    known = s.lora_models.get(name)
    base = known.host_name if known is not None else _lora_base(s)
    if known is not None and not body.load_inplace:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    if known is not None:  # load_inplace: the new files replace the old under the same name
        s.lora_models.pop(name, None)
        await s.host.remove_lora(base, name)
    lora_int_id = 1 + max((m.lora_request.lora_int_id for m in s.lora_models.values()), default=0)
    try:
        request = LoRARequest(name, lora_int_id, body.lora_path)
        await s.host.add_lora(base, request)
    except ValueError as err:
        message = str(err)
        raise bad_request(message, "lora_name" if message.startswith("lora_name") else "lora_path") from err
    s.add_lora_model(base, request)
    s.sync_lora_models()  # an engine core in its own process numbered it: its list wins
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest,
    s: OpenAIServing = Depends(serving),  # noqa: B008
) -> PlainTextResponse:
    name = body.lora_name
    await s.refresh_lora_models()
    model = s.lora_models.pop(name, None)  # new requests naming it get 404 from here on
    # False: another front end unloaded it meanwhile (an engine core in its own process)
    if model is None or not await s.host.remove_lora(model.host_name, name):
        raise ServingError(404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError", param="lora_name")
    s.sync_lora_models()
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
