"""``POST /v1/embeddings``: OpenAI's Embeddings API over the served generative model.

Knows: the request and response shapes (``input`` as a string, strings, token ids or lists
of token ids; ``encoding_format`` ``float`` or ``base64``, the latter little-endian float32
as OpenAI sends it; ``dimensions``; ``usage``), and that an input becomes an engine request
with ``PoolingParams`` through ``OpenAIServing``'s prompt checks, queue checks and submission
(API keys, tenants, limits as every other route). Must not know: how the engine pools (see
``qserve.pooling_params``: the last prompt token's final hidden state, L2-normalized, as vLLM
does for a ``*ForCausalLM`` model run as an embedding model), routes' auth, uvicorn.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from qserve.pooling_params import PoolingParams
from qserve.server.protocol import OpenAIModel, TokenIds
from qserve.server.request_limits import RequestLimitError, check_text
from qserve.server.serving import OpenAIServing, ServedModel, ServingError, _Prompt, _Submission, bad_request


class EmbeddingRequest(OpenAIModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's extra: text inputs get the tokenizer's BOS etc.


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode_base64(vector: list[float]) -> str:
    """OpenAI's ``encoding_format: "base64"``: the float32 values, little-endian, base64."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _inputs(raw: Any) -> list[str | list[int]]:
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(x, int) for x in raw):
        return [list(raw)]
    return list(raw)


def _hidden_size(serving: OpenAIServing, model: ServedModel) -> int:
    return serving.host.models[model.host_name].engine.model_config.hidden_size


async def create_embedding(
    serving: OpenAIServing, request: EmbeddingRequest, tenant: str | None = None
) -> EmbeddingResponse:
    try:
        check_text(request)
    except RequestLimitError as err:
        raise bad_request(str(err), err.param) from err
    model = serving._model(request.model)  # noqa: SLF001 - the shared front-end helpers of OpenAIServing
    items = _inputs(request.input)
    if not items:
        raise bad_request("input is empty: give a string, a list of strings or token ids", "input")
    limit = serving.limits.max_sequences  # the server's cap on sequences one request queues
    if len(items) > limit:
        raise bad_request(f"input has {len(items)} items; at most {limit} are allowed in one request", "input")
    params = PoolingParams(dimensions=request.dimensions)
    try:
        params.verify(_hidden_size(serving, model))
    except ValueError as err:
        raise bad_request(str(err), "dimensions") from err
    serving._check_queue(model.host_name, len(items))  # noqa: SLF001
    prompts: list[_Prompt] = []
    for i, item in enumerate(items):
        param = "input" if len(items) == 1 else f"input.{i}"
        if isinstance(item, str):
            if not item:
                raise bad_request("an input string is empty: at least one token is needed", param)
            ids = await serving._encode(model, item, param, add_special_tokens=request.add_special_tokens)  # noqa: SLF001
            prompt = _Prompt(ids, item)
        else:
            prompt = _Prompt(list(item), None)
            serving._check_vocab(model, prompt, param)  # noqa: SLF001
        if not prompt.token_ids:
            raise bad_request("an input is empty: at least one token is needed", param)
        if len(prompt.token_ids) >= model.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {model.max_model_len} tokens. However, input {i} is "
                f"{len(prompt.token_ids)} tokens long; embeddings take at most {model.max_model_len - 1}.",
                param,
            )
        prompts.append(prompt)
    base_id = f"embd-{uuid.uuid4().hex}"
    request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
    submission = _Submission(request_ids, prompts, params, {rid: i for i, rid in enumerate(request_ids)})  # type: ignore[arg-type]
    stream = await serving._submit(model, submission, "input", tenant)  # noqa: SLF001
    final = await serving._collect(stream)  # noqa: SLF001
    data = []
    num_tokens = 0
    for index, request_id in enumerate(request_ids):
        output = final.get(request_id)
        vector = None if output is None else output.embedding
        if vector is None:
            raise ServingError(
                503, "the request was aborted before its embedding was computed", type="ServiceUnavailableError"
            )
        num_tokens += len(output.prompt_token_ids)
        encoded = encode_base64(vector) if request.encoding_format == "base64" else vector
        data.append(EmbeddingData(index=index, embedding=encoded))
    return EmbeddingResponse(
        id=base_id, model=model.name, data=data, usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    )


def add_embedding_routes(
    app: FastAPI,
    *,
    require_api_key: Callable[..., Any],
    serving: Callable[[], OpenAIServing],
    respond: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
    tenant_of: Callable[[Request], dict[str, str]],
) -> None:
    """Register ``POST /v1/embeddings``; ``respond`` runs the work unless the client leaves first."""

    @app.post("/v1/embeddings", dependencies=[Depends(require_api_key)])
    async def embeddings(
        body: EmbeddingRequest,
        request: Request,
        s: OpenAIServing = Depends(serving),  # noqa: B008
    ) -> Any:
        return await respond(request, create_embedding(s, body, **tenant_of(request)))
