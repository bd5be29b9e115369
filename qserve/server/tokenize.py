"""vLLM's tokenizer routes: ``POST /tokenize`` and ``POST /detokenize``.

Knows: their request / response shapes (vLLM's: ``{"count", "max_model_len", "tokens",
"token_strs"}`` and ``{"prompt"}``), and how they use a served model's front-end tokenizer
and chat template (through ``OpenAIServing``: the same bounded, off-the-event-loop path as the
completion routes). Must not know: engines, uvicorn, metrics, the API key (``app`` applies it).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from qserve.server.protocol import ChatCompletionRequest, ChatMessage, OpenAIModel
from qserve.server.request_limits import RequestLimitError, check_text
from qserve.server.route_support import serving
from qserve.server.serving import OpenAIServing, ServedModel, ServingError, bad_request

router = APIRouter()


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


def _served_model(s: OpenAIServing, name: str | None) -> ServedModel:
    """The model a tokenizer request names; it may be left out when only one is served."""
    if name is None:
        if len(s.models) == 1:
            return next(iter(s.models.values()))
        raise bad_request(f"model is required: this server serves {', '.join(s.models)}", "model")
    model = s.models.get(name) or s.lora_models.get(name)  # an adapter tokenizes as its base model
    if model is None:
        served = ", ".join([*s.models, *s.lora_models])
        raise ServingError(
            404, f"The model `{name}` does not exist. Served models: {served}.", type="NotFoundError", param="model"
        )
    return model


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, s: OpenAIServing = Depends(serving)) -> TokenizeResponse:  # noqa: B008
    try:
        check_text(body)  # a lone surrogate is a 400 naming the field, as on the completion routes
    except RequestLimitError as err:
        raise bad_request(str(err), err.param) from err
    if body.model is not None:  # an adapter loaded through another front end (no name: the only base)
        await s.refresh_lora_models(body.model)
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


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: OpenAIServing = Depends(serving)) -> DetokenizeResponse:  # noqa: B008
    if body.model is not None:  # an adapter loaded through another front end (no name: the only base)
        await s.refresh_lora_models(body.model)
    model = _served_model(s, body.model)
    if body.tokens and max(body.tokens) >= model.vocab_size:  # max(): C speed on 262k ids
        bad = next(t for t in body.tokens if t >= model.vocab_size)
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {model.vocab_size})", "tokens")
    if model.prompts is None:
        return DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens))
    # Off the loop, like tokenization: decoding 262k ids takes 0.15 s.
    return DetokenizeResponse(prompt=await model.prompts.decode(body.tokens))
