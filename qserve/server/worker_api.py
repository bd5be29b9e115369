"""The routes a router or orchestrator reads from a vLLM-compatible worker, beyond the
OpenAI endpoints: ``/version``, ``/ping``, ``/v1/models/{id}``, ``/tokenize``, ``/detokenize``.

Knows: their request / response shapes (vLLM's: ``{"count", "max_model_len", "tokens",
"token_strs"}`` and ``{"prompt"}``), and how they use a served model's front-end tokenizer
and chat template (through ``OpenAIServing``). ``/version`` and ``/ping`` answer without a
key, like ``/health``; the others take the same dependencies (API key, ready check) as the
``/v1`` routes. Must not know: engines, uvicorn, metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, Field

from qserve import __version__
from qserve.server.protocol import ChatCompletionRequest, ChatMessage, ModelCard, OpenAIModel
from qserve.server.serving import OpenAIServing, ServedModel, ServingError, bad_request


class TokenizeRequest(OpenAIModel):
    """vLLM's ``/tokenize`` body: either ``prompt`` (completion form) or ``messages`` (chat form)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def _served_model(s: OpenAIServing, name: str | None) -> ServedModel:
    """The model a tokenizer request names; it may be left out when only one is served."""
    if name is None:
        if len(s.models) == 1:
            return next(iter(s.models.values()))
        raise bad_request(f"model is required: this server serves {', '.join(s.models)}", "model")
    model = s.models.get(name)
    if model is None:
        served = ", ".join(s.models)
        raise ServingError(
            404, f"The model `{name}` does not exist. Served models: {served}.", type="NotFoundError", param="model"
        )
    return model


def add_worker_routes(
    app: FastAPI,
    *,
    health: Callable[[], Any],
    require_api_key: Callable[..., Any],
    serving: Callable[[], OpenAIServing],
) -> None:
    """Register the routes on ``app``; ``health`` is the ``/health`` handler (``/ping`` repeats it)."""

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
    async def retrieve_model(model_id: str, s: OpenAIServing = Depends(serving)) -> ModelCard:  # noqa: B008
        for card in s.list_models().data:
            if card.id == model_id:
                return card
        served = ", ".join(s.models)
        message = f"The model `{model_id}` does not exist. Served models: {served}."
        raise ServingError(404, message, type="NotFoundError", param="model")

    @app.post("/tokenize", dependencies=[Depends(require_api_key)])
    async def tokenize(body: TokenizeRequest, s: OpenAIServing = Depends(serving)) -> TokenizeResponse:  # noqa: B008
        model = _served_model(s, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        tokenizer = model.tokenizer
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages is empty", "messages")
            chat = ChatCompletionRequest(
                model=model.name,
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            prompt = await s._chat_prompt(model, chat)  # noqa: SLF001 - the same template path as chat
            tokens = list(prompt.token_ids)
            if body.add_special_tokens:  # vLLM's default for messages is False: the template adds them
                tokens = await s._encode(model, prompt.text or "", "messages", add_special_tokens=True)  # noqa: SLF001
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            # The same bounded, off-the-event-loop tokenization as the completion routes.
            tokens = await s._encode(model, body.prompt, "prompt", add_special_tokens=add_special)  # noqa: SLF001
        strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=model.max_model_len, tokens=tokens, token_strs=strs)

    @app.post("/detokenize", dependencies=[Depends(require_api_key)])
    async def detokenize(body: DetokenizeRequest, s: OpenAIServing = Depends(serving)) -> DetokenizeResponse:  # noqa: B008
        model = _served_model(s, body.model)
        bad = next((t for t in body.tokens if t >= model.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {model.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens))
