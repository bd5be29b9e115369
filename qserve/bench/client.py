"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

Knows: the request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (streaming, with
``stream_options.include_usage`` so the server counts the output tokens), how server-sent events
are read, and vLLM ``bench serve``'s timing definitions: TTFT = first chunk carrying a token
minus send time; ITL = gaps between successive such chunks; latency (E2E) = send to end of
stream. A chunk is a token step even when its text is empty (qserve and vLLM send one per step).
Must not know: how load is generated or summarised.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from qserve.bench.dataset import SampleRequest

CHAT_ENDPOINTS = ("/v1/chat/completions",)


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times in seconds; ``start`` is ``time.perf_counter()``."""

    prompt_len: int
    success: bool = False
    status: int | None = None  # HTTP status; None when no response came (connection error)
    error: str = ""
    output_tokens: int = 0  # from usage.completion_tokens, else the number of token chunks
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    text: str = ""
    retry_after: str | None = None  # the Retry-After header of a 429 / 503


def request_body(endpoint: str, model: str, request: SampleRequest, *, ignore_eos: bool, extra: dict) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint in CHAT_ENDPOINTS:
        if not isinstance(request.prompt, str):
            raise ValueError(f"{endpoint} takes text prompts; give --tokenizer so token ids can be decoded")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; qserve has it too
    body.update(extra)
    return body


def _token_chunk(chunk: dict, chat: bool) -> tuple[bool, str]:
    """(does this chunk carry a token step, its text)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False, ""  # the usage chunk
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        if "role" in delta:  # the opening chunk names the role; it carries no token
            return False, delta.get("content") or ""
        return True, delta.get("content") or ""
    return True, choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    prompt_len: int,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POST ``body`` to ``url`` and read the stream to its end. Never raises for a failed request:
    the failure (HTTP status, error body or exception) is in the result."""
    chat = any(url.endswith(e) for e in CHAT_ENDPOINTS)
    result = RequestResult(prompt_len=prompt_len)
    num_chunks = 0
    parts: list[str] = []
    start = result.start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.retry_after = response.headers.get("retry-after")
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = _error_message(text) or f"HTTP {response.status_code}"
                result.latency = time.perf_counter() - start
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = _error_message(data) or "error in stream"
                    break
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                is_token, text = _token_chunk(chunk, chat)
                if not is_token:
                    continue
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
                parts.append(text)
            result.latency = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as err:
        result.error = f"{type(err).__name__}: {err}"
        result.latency = time.perf_counter() - start
        return result
    result.text = "".join(parts)
    if not result.output_tokens:
        result.output_tokens = num_chunks  # a server without usage in streams: one token a chunk
    result.success = not result.error and num_chunks > 0
    if not result.success and not result.error:
        result.error = "the stream ended without a token"
    return result


def _error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error")
    except (json.JSONDecodeError, AttributeError):
        return text.strip()[:200]
    if isinstance(error, dict):
        return str(error.get("message", ""))[:200]
    return str(error or "")[:200]
