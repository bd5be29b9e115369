"""Bounds on what a JSON request body may hold, checked before FastAPI parses it on the event loop.

Knows: how much work a body can cost before any route sees it (FastAPI decodes the JSON and
pydantic validates it on the event loop, in single C calls that hold the GIL: 470k one-word chat
messages froze every route, ``/health`` included, for 11 s), the caps that bound that work
(``BodyLimits``: JSON values in one body, chat messages, prompts, token ids), and the ASGI
protocol well enough to read a buffered body and pass it on. Must not know: routes' logic,
engines, pydantic models, OpenAI shapes beyond the error body (``respond`` builds it).

How: a body small enough to be cheap (``scan_above_bytes``, or few enough JSON separators that
it cannot hold many values) goes straight on. A larger one is decoded in a worker thread by
the pure-Python JSON scanner, which gives the GIL back between values (the C decoder and
pydantic do not: a thread does not help them), counting values as it goes and stopping at
``max_json_values``; then the top-level ``messages``, ``prompt`` and ``tokens`` are counted.
Over a cap: 400 naming it, before any per-item work. Under the caps, what FastAPI and the
routes then do on the loop is bounded (measured: under 100 ms at the caps on a 2-core CPU).
"""

from __future__ import annotations

import asyncio
import json
import json.decoder
import json.scanner
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# respond(status, message, param) -> an ASGI app that sends the error body
Responder = Callable[[int, str, str | None], ASGIApp]


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What one JSON body may hold. The defaults keep the loop's share of a request (JSON
    decode, validation, the routes' walks) under about 100 ms."""

    max_json_values: int = 300_000  # strings, numbers, objects and arrays in one body
    max_messages: int = 2048  # chat messages (OpenAI's own cap on `messages`)
    max_prompts: int = 256  # prompts in one /v1/completions request (request_limits.RequestLimits)
    max_token_ids: int = 262_144  # token ids in one body: token-id prompts, /detokenize `tokens`
    scan_above_bytes: int = 64 << 10  # smaller bodies cannot hold enough to matter


DEFAULT_BODY_LIMITS = BodyLimits()
# A body with at most this many JSON values costs the loop a few ms to decode and validate.
CHEAP_VALUES = 20_000


class BodyLimitError(ValueError):
    """A body over a cap; ``param`` names the field (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class _TooManyValues(Exception):
    pass


def _counting_decoder(limit: int) -> json.JSONDecoder:
    """A JSON decoder built on the pure-Python scanner (it returns to the interpreter between
    values, so other threads, the event loop's included, keep running) that raises
    ``_TooManyValues`` once it has made more than ``limit`` values."""
    count = 0

    def counted(parse: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            nonlocal count
            count += 1
            if count > limit:
                raise _TooManyValues
            return parse(*args)

        return wrapper

    decoder = json.JSONDecoder()
    decoder.parse_string = counted(json.decoder.scanstring)  # type: ignore[attr-defined]
    decoder.parse_object = counted(json.decoder.JSONObject)  # type: ignore[attr-defined]
    decoder.parse_array = counted(json.decoder.JSONArray)  # type: ignore[attr-defined]
    decoder.parse_int = counted(int)  # type: ignore[assignment]
    decoder.parse_float = counted(float)  # type: ignore[assignment]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder


def value_bound(body: bytes) -> int:
    """An upper bound on the JSON values in ``body`` (each value past a container's first is
    preceded by a comma); C-speed, so it decides cheaply whether a body needs counting."""
    return body.count(b",") + body.count(b"[") + body.count(b"{") + 1


def _count_prompts(prompt: Any) -> tuple[int, int]:
    """(prompts, token ids) of a completions ``prompt``: a string or one token list is one prompt."""
    if not isinstance(prompt, list) or not prompt:
        return 1, 0
    if all(isinstance(x, int) for x in prompt):
        return 1, len(prompt)
    return len(prompt), sum(len(x) for x in prompt if isinstance(x, list))


def check_body(body: bytes, limits: BodyLimits = DEFAULT_BODY_LIMITS) -> None:
    """Raise ``BodyLimitError`` if ``body`` (JSON) is over a cap. Slow on a large body: run it
    in a worker thread. A body that is not JSON passes (the route reports that)."""
    if value_bound(body) <= CHEAP_VALUES:
        return  # decoded and validated on the loop in a few ms; the routes check the caps
    try:
        data = _counting_decoder(limits.max_json_values).decode(body.decode("utf-8"))
    except _TooManyValues:
        raise BodyLimitError(
            f"the request body holds more than {limits.max_json_values} JSON values (strings, numbers, objects, "
            "arrays); split it into several requests",
            None,
        ) from None
    except (ValueError, RecursionError):  # not JSON (or nested past the stack): the route's own error
        return
    if not isinstance(data, dict):
        return
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise BodyLimitError(
            f"messages: {len(messages)} messages in one request; at most {limits.max_messages} are allowed",
            "messages",
        )
    prompts, token_ids = _count_prompts(data.get("prompt"))
    if prompts > limits.max_prompts:
        raise BodyLimitError(
            f"prompt: {prompts} prompts in one request; at most {limits.max_prompts} are allowed", "prompt"
        )
    if token_ids > limits.max_token_ids:
        raise BodyLimitError(
            f"prompt: {token_ids} token ids in one request; at most {limits.max_token_ids} are allowed", "prompt"
        )
    tokens = data.get("tokens")
    if isinstance(tokens, list) and len(tokens) > limits.max_token_ids:
        raise BodyLimitError(
            f"tokens: {len(tokens)} token ids in one request; at most {limits.max_token_ids} are allowed", "tokens"
        )


class BodyGate:
    """ASGI middleware; see the module docstring. Sits inside ``RequestGuard`` (which has
    checked the key and the body's size and buffered it)."""

    def __init__(self, app: ASGIApp, respond: Responder, limits: BodyLimits = DEFAULT_BODY_LIMITS) -> None:
        self.app = app
        self.respond = respond
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        content_type = Headers(scope=scope).get("content-type", "")
        if "json" not in content_type.lower():
            await self.app(scope, receive, send)
            return
        messages, body = await _read(receive)
        if body is not None and len(body) >= self.limits.scan_above_bytes:
            try:
                await asyncio.to_thread(check_body, body, self.limits)
            except BodyLimitError as err:
                await self.respond(400, str(err), err.param)(scope, _replay(messages, receive), send)
                return
        await self.app(scope, _replay(messages, receive), send)


async def _read(receive: Receive) -> tuple[list[Message], bytes | None]:
    """The body's messages and bytes (None if the client left before the end)."""
    messages: list[Message] = []
    chunks: list[bytes] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return messages, b"".join(chunks)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
