"""``/v1/responses``: OpenAI's Responses API, served by the chat path.

Knows: the Responses request shape (``input`` as a string or items: messages whose content is
a string or ``input_text`` / ``output_text`` parts, ``function_call`` and
``function_call_output`` items; ``instructions``; flat function ``tools``; ``tool_choice``;
``text.format``; ``max_output_tokens``; ``previous_response_id``; ``store``), how such a
request becomes a ``ChatCompletionRequest`` (so the chat template, sampling defaults, tool
parsing, structured outputs, limits and tenants are the chat route's, called, not copied), how
a chat answer becomes a Response object (``message`` items with ``output_text`` parts,
``function_call`` items, ``usage``, ``status`` / ``incomplete_details``), how chat's SSE chunks
become the Responses event sequence (``response.created`` ... ``response.completed``, each with
a ``sequence_number``), and the bounded in-memory store of responses that
``previous_response_id`` and ``GET /v1/responses/{id}`` read. Must not know: engines,
tokenizers, uvicorn.

Accepted and not acted on (qserve's models have no separate reasoning, no hosted tools):
``reasoning``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``user``,
``text.verbosity``; ``metadata`` is echoed. Refused with a 400 naming the field: other tool
types, image / file / audio inputs, ``truncation: "auto"``, ``background: true``, ``include``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    OpenAIModel,
    ResponseFormat,
    StreamOptions,
    ToolCall,
)
from qserve.server.serving import OpenAIServing, ServingError, bad_request

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 512  # the in-memory store keeps the most recently used ones


# ---------------------------------------------------------------------- request
class FunctionTool(OpenAIModel):
    """A Responses function tool: flat, unlike chat's ``{"type", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextConfig(OpenAIModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not acted on


class ResponsesRequest(OpenAIModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]  # items are checked one by one (errors name input.<i>.<field>)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extra sampling fields, passed to the chat path as they are
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None


class _Part(OpenAIModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _MessageItem(OpenAIModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_Part]
    id: str | None = None
    status: str | None = None


class _FunctionCallItem(OpenAIModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _FunctionCallOutputItem(OpenAIModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Part]
    id: str | None = None
    status: str | None = None


_ITEM_TYPES: dict[str, type[OpenAIModel]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionCallOutputItem,
}
_UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


# ---------------------------------------------------------------------- the store
@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as sent
    conversation: list[ChatMessage]  # its input (without instructions) and output, for previous_response_id


class ResponseStore:
    """The server's memory of stored responses: the ``capacity`` most recently used (LRU)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def _not_found(response_id: str, param: str | None) -> ServingError:
    return ServingError(404, f"Response with id '{response_id[:200]}' not found.", type="NotFoundError", param=param)


# ---------------------------------------------------------------------- request -> chat request
def _text_of(content: str | list[_Part]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _parse_items(raw: list[dict[str, Any]]) -> list[Any]:
    items = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(
                f"input item type {kind!r} is not supported (supported: {', '.join(_ITEM_TYPES)})", f"input.{i}.type"
            )
        content = item.get("content", item.get("output"))
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in _UNSUPPORTED_PARTS:
                    field = "content" if "content" in item else "output"
                    raise bad_request(
                        f"{part['type']} is not supported: qserve serves text-only models", f"input.{i}.{field}.{j}"
                    )
        try:
            items.append(model.model_validate(item))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            reason = "unsupported field" if first.get("type") == "extra_forbidden" else str(first.get("msg"))
            param = f"input.{i}.{where}" if where else f"input.{i}"
            raise bad_request(f"{param}: {reason}", param) from None
    return items


def _to_messages(items: list[Any]) -> list[ChatMessage]:
    """Input items as chat messages; consecutive function calls join the assistant turn before them."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, _MessageItem):
            messages.append(ChatMessage(role=item.role, content=_text_of(item.content)))
        elif isinstance(item, _FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", content=_text_of(item.output), tool_call_id=item.call_id))
    return messages


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise bad_request("background responses are not supported", "background")
    if body.include:
        raise bad_request(f"include={body.include} is not supported", "include")


def _chat_request(body: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.stream:
        fields["stream_options"] = StreamOptions(include_usage=True)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "user"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    try:
        if body.tools:
            fields["tools"] = [
                ChatTool(
                    type="function",
                    function=FunctionDefinition(
                        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                    ),
                )
                for t in body.tools
            ]
    except ValidationError as err:
        raise bad_request(f"tools: {err.errors()[0].get('msg')}", "tools") from None
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        fields["tool_choice"] = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    elif choice is not None:
        fields["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = ResponseFormat(
            type="json_schema",
            json_schema=JsonSchemaFormat(
                name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict
            ),
        )
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = ResponseFormat(type="json_object")
    return ChatCompletionRequest(**fields)


# Chat's parameter names as the Responses API calls them (errors name the field the client sent).
_PARAM_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "stream_options": "stream",
}


def _renamed(err: ServingError) -> ServingError:
    if err.param:
        head, _, rest = err.param.partition(".")
        if head == "messages":
            rest = ""  # message indices count instructions and earlier turns: name the input
        if head == "response_format":
            rest = rest.removeprefix("json_schema").lstrip(".")
        if head in _PARAM_NAMES:
            err.param = _PARAM_NAMES[head] + (f".{rest}" if rest else "")
    return err


# ---------------------------------------------------------------------- chat answer -> response
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {
        "id": _new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": _new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


@dataclass
class _Context:
    """One Responses request on its way through the chat path."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    conversation: list[ChatMessage]  # earlier turns and this input, without instructions
    response_id: str
    created_at: int

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        body, chat = self.body, self.chat
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": body.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": chat.temperature if chat.temperature is not None else 1.0,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else (choice or "auto"),
            "tools": [t.model_dump() for t in body.tools or []],
            "top_p": chat.top_p if chat.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": _usage(usage),
            "user": body.user,
        }

    def finished(self, store: ResponseStore, response: dict[str, Any]) -> None:
        """Keep a finished response (``store``): its conversation continues from it."""
        if not self.body.store:
            return
        texts = [part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]]
        calls = [
            ToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=item["arguments"]))
            for item in response["output"]
            if item["type"] == "function_call"
        ]
        answer = ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None)
        store.put(self.response_id, StoredResponse(response, [*self.conversation, answer]))


def _output_of(chat: ChatCompletionResponse) -> tuple[list[dict[str, Any]], str]:
    choice = chat.choices[0]
    status = _status(choice.finish_reason)
    item_status = "incomplete" if status == "incomplete" else "completed"
    calls = choice.message.tool_calls or []
    output = []
    if choice.message.content or not calls:
        output.append(_message_item(choice.message.content or "", item_status))
    output += [_call_item(c.id, c.function.name, c.function.arguments, "completed") for c in calls]
    return output, status


# ---------------------------------------------------------------------- streaming
class _EventStream:
    """Responses events made from a chat stream: closing it closes the chat stream (which aborts
    the engine request), even if no event was ever read."""

    def __init__(self, events: AsyncIterator[str], source: Any) -> None:
        self._events = events
        self._source = source

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> str:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()  # type: ignore[attr-defined]
        finally:
            await self._source.aclose()


class _EventWriter:
    """Numbered Responses SSE events, and the output items they build."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _add(self, item: dict[str, Any]) -> list[str]:
        events = self.close("completed")
        self.output.append(item)
        self.open = item
        return [*events, self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def text(self, delta: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != "message":
            item = _message_item("", "in_progress")
            part = item["content"].pop()
            events += self._add(item)  # the item is announced with no content part yet
            item["content"].append(part)
            events.append(self._part_event("response.content_part.added", item, part))
        item = self.open
        assert item is not None
        if not delta:
            return events
        item["content"][0]["text"] += delta
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def call(self, call_id: str, name: str) -> list[str]:
        return self._add(_call_item(call_id, name, "", "in_progress"))

    def arguments(self, delta: str) -> list[str]:
        item = self.open
        if item is None or item["type"] != "function_call" or not delta:
            return []
        item["arguments"] += delta
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                delta=delta,
            )
        ]

    def _part_event(self, kind: str, item: dict[str, Any], part: dict[str, Any]) -> str:
        return self.event(kind, item_id=item["id"], output_index=len(self.output) - 1, content_index=0, part=part)

    def close(self, status: str) -> list[str]:
        """Finish the open item (``status``: the item's final status)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output) - 1
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(self._part_event("response.content_part.done", item, part))
            item["status"] = status
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


async def _stream_events(
    context: _Context, chat_stream: AsyncIterator[str], store: ResponseStore
) -> AsyncIterator[str]:
    writer = _EventWriter()
    started = context.response("in_progress", [], None)
    yield writer.event("response.created", response=started)
    yield writer.event("response.in_progress", response=started)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    async for raw in chat_stream:
        payload = raw.removeprefix("data: ").strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        error = chunk.get("error")
        if error is not None:  # the chat stream failed after the status was sent
            yield writer.event("error", code=error.get("type"), message=error.get("message", ""), param=None)
            failed = context.response("failed", writer.output, usage)
            failed["error"] = {"code": "server_error", "message": error.get("message", "")}
            yield writer.event("response.failed", response=failed)
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):
                    for event in writer.call(call["id"], function.get("name") or ""):
                        yield event
                for event in writer.arguments(function.get("arguments") or ""):
                    yield event
            if delta.get("content"):
                for event in writer.text(delta["content"]):
                    yield event
            if choice.get("finish_reason"):
                finish_reason = choice["finish_reason"]
    status = _status(finish_reason)
    if not writer.output:  # nothing generated: an empty message, as the non-streamed answer has
        for event in writer.text(""):
            yield event
    for event in writer.close("incomplete" if status == "incomplete" else "completed"):
        yield event
    final = context.response(status, writer.output, usage)
    context.finished(store, final)
    yield writer.event("response.incomplete" if status == "incomplete" else "response.completed", response=final)


# ---------------------------------------------------------------------- the endpoint
async def create_response(
    serving: OpenAIServing,
    store: ResponseStore,
    body: ResponsesRequest,
    apply_defaults: Callable[[ChatCompletionRequest], None],
    tenant: str | None = None,
) -> dict[str, Any] | AsyncIterator[str]:
    _refuse_unsupported(body)
    conversation: list[ChatMessage] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        conversation = [m.model_copy(deep=True) for m in previous.conversation]
    if isinstance(body.input, str):
        conversation.append(ChatMessage(role="user", content=body.input))
    else:
        conversation += _to_messages(_parse_items(body.input))
    if not conversation:
        raise bad_request("input is empty: give a string or at least one input item", "input")
    messages = list(conversation)
    if body.instructions:
        messages.insert(0, ChatMessage(role="system", content=body.instructions))
    chat = _chat_request(body, [m.model_copy(deep=True) for m in messages])
    await serving.refresh_lora_models(chat.model)  # an adapter loaded elsewhere: its base's defaults
    apply_defaults(chat)
    context = _Context(body, chat, conversation, _new_id("resp"), int(time.time()))
    try:
        result = await serving.create_chat_completion(chat, tenant=tenant)
    except ServingError as err:
        raise _renamed(err) from err
    if isinstance(result, ChatCompletionResponse):
        output, status = _output_of(result)
        usage = result.usage.model_dump() if result.usage is not None else None
        response = context.response(status, output, usage)
        context.finished(store, response)
        return response
    return _EventStream(_stream_events(context, result, store), result)


def add_responses_routes(
    app: FastAPI,
    *,
    require_api_key: Callable[..., Any],
    serving: Callable[[], OpenAIServing],
    respond: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
    tenant_of: Callable[[Request], dict[str, str]],
    apply_defaults: Callable[[ChatCompletionRequest], None],
    store: ResponseStore | None = None,
) -> ResponseStore:
    """Register ``POST /v1/responses`` and ``GET`` / ``DELETE /v1/responses/{id}``; returns the store."""
    responses = store if store is not None else ResponseStore()

    @app.post("/v1/responses", dependencies=[Depends(require_api_key)])
    async def create(body: ResponsesRequest, request: Request, s: OpenAIServing = Depends(serving)) -> Any:  # noqa: B008
        return await respond(request, create_response(s, responses, body, apply_defaults, **tenant_of(request)))

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(require_api_key)])
    async def retrieve(response_id: str) -> Any:
        stored = responses.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return stored.response

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(require_api_key)])
    async def delete(response_id: str) -> Any:
        if not responses.delete(response_id):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return responses
