"""Per-request caps and text checks for OpenAI requests, applied before any work is done.

Knows: the parsed request models' field names (``prompt``, ``messages``, ``n``, ``stop``,
``stop_token_ids``), the caps one request may ask for, and what counts as valid text (a string
that encodes as UTF-8: no lone surrogates such as ``"\\ud800"``, which JSON escapes allow).
Must not know: engines, tokenizers, HTTP.

Why here and not in the pydantic models: a cap must name the field in a 400 and must not echo
the (unbounded) input; the request's total size (prompts x n) spans several fields. Errors are
``ValueError``s whose ``param`` attribute names the field (``RequestLimitError``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


class RequestLimitError(ValueError):
    """A request over a cap or with invalid text; ``param`` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for (the defaults bound the work of one request to well under
    what a server with ``--max-num-seqs 256`` does in a few steps)."""

    max_prompts: int = 256  # prompts in one /v1/completions request
    max_messages: int = 2048  # chat messages (OpenAI's cap; large bodies are also counted by body_gate)
    max_sequences: int = 1024  # prompts x n
    max_stop: int = 64  # stop strings
    max_stop_chars: int = 512  # characters of one stop string
    max_stop_token_ids: int = 1024


DEFAULT_LIMITS = RequestLimits()


def clip(text: str, limit: int = 80) -> str:
    """``text`` for an error message: at most ``limit`` characters, always encodable."""
    if len(text) > limit:
        text = text[:limit] + f"... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _encodable_json(value: Any) -> bool | None:
    """True if ``value`` is plain JSON data whose every string (keys included) encodes as UTF-8,
    False if one does not, None if it is not plain JSON (pydantic models inside): one C-speed
    pass instead of a walk (a 290k-value ``chat_template_kwargs`` cost the loop 0.15 s)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid_text(value: Any, path: str, fast: bool = True) -> Iterator[str]:
    """Paths (``messages.0.content``) of strings in ``value`` that are not encodable text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            yield path
    elif isinstance(value, BaseModel):
        fields = dict(value)
        fields.update(value.model_extra or {})
        for key, item in fields.items():
            yield from _invalid_text(item, f"{path}.{key}" if path else str(key), fast)
    elif isinstance(value, dict):
        if fast and _encodable_json(value):
            return  # (False or None: walk it, once, to name the field)
        for key, item in value.items():
            key_path = f"{path}.{clip(str(key), 40)}" if path else clip(str(key), 40)
            yield from _invalid_text(key, key_path, False)
            yield from _invalid_text(item, key_path, False)
    elif isinstance(value, (list, tuple)):
        if value and set(map(type, value)) == {int}:
            return  # token ids (a C-speed test: 262k ids cost the walk 1 s one by one)
        encodable = _encodable_json(value) if fast else None
        if encodable:
            return
        for index, item in enumerate(value):  # after a False, walk without retrying the fast pass
            yield from _invalid_text(item, f"{path}.{index}" if path else str(index), fast and encodable is None)


def check_text(request: BaseModel) -> None:
    """Every string of the request (values and keys, extra fields included) must be valid
    UTF-8 text; the 400 names the first field that is not."""
    bad = next(_invalid_text(request, ""), None)
    if bad is not None:
        raise RequestLimitError(
            f"{bad}: the text is not valid Unicode (it contains a lone surrogate such as \\ud800)", bad
        )


def num_prompts(prompt: Any) -> int:
    """Prompts in a completions ``prompt`` field: a string or one token list is one prompt."""
    if isinstance(prompt, str) or not prompt:
        return 1
    if all(isinstance(x, int) for x in prompt):
        return 1
    return len(prompt)


def check_limits(request: Any, limits: RequestLimits = DEFAULT_LIMITS) -> int:
    """Check the caps; return the sequences the request would queue (prompts x n)."""
    prompts = num_prompts(request.prompt) if hasattr(request, "prompt") else 1
    if prompts > limits.max_prompts:
        raise RequestLimitError(
            f"prompt: {prompts} prompts in one request; at most {limits.max_prompts} are allowed", "prompt"
        )
    messages = getattr(request, "messages", None)
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise RequestLimitError(
            f"messages: {len(messages)} messages in one request; at most {limits.max_messages} are allowed",
            "messages",
        )
    n = request.n
    if prompts * n > limits.max_sequences:
        raise RequestLimitError(
            f"n: {prompts} prompts x n={n} asks for {prompts * n} sequences; at most "
            f"{limits.max_sequences} per request",
            "n",
        )
    stop = request.stop
    if isinstance(stop, list):
        if len(stop) > limits.max_stop:
            raise RequestLimitError(f"stop: {len(stop)} stop strings; at most {limits.max_stop} are allowed", "stop")
        stops = stop
    else:
        stops = [] if stop is None else [stop]
    longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
    if longest > limits.max_stop_chars:
        raise RequestLimitError(
            f"stop: a stop string of {longest} characters; at most {limits.max_stop_chars} are allowed", "stop"
        )
    stop_ids = request.stop_token_ids
    if stop_ids is not None and len(stop_ids) > limits.max_stop_token_ids:
        raise RequestLimitError(
            f"stop_token_ids: {len(stop_ids)} ids; at most {limits.max_stop_token_ids} are allowed",
            "stop_token_ids",
        )
    return prompts * n
