"""The tool-call text formats of vLLM's ``mistral``, ``pythonic``, ``qwen3_coder`` and
``deepseek_v3`` parsers: whole model outputs in, ``(content, [(name, arguments)])`` out.

Knows: each format, as the models' chat templates teach it:

- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (tokenizers
  before v11), or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 and later). The marker
  is a special token: the output must keep special tokens (``tools`` asks for that).
- ``pythonic`` (Llama 3.2 / 4): a Python list of calls with keyword arguments,
  ``[get_weather(city="Paris", days=2), get_time()]``, optionally inside
  ``<|python_start|>`` ... ``<|python_end|>``; literals only (nothing is evaluated).
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
  </tool_call>``; values are text, typed by the tool's JSON schema (integer, number,
  boolean, object, array; a string stays a string).
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``,
  the arguments in a ```` ```json ```` block, ``<｜tool▁call▁end｜>`` ... ``<｜tool▁calls▁end｜>``.

Text before the first call is content. An output that does not parse is content, whole.
Must not know: OpenAI shapes (``tools`` builds the calls), HTTP, engines.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

Calls = list[tuple[str, Any]]  # (function name, arguments: an object, or JSON text)

MISTRAL_MARKER = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
QWEN3_CODER_MARKER = "<tool_call>"
DEEPSEEK_V3_MARKER = "<｜tool▁calls▁begin｜>"

_QWEN3_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_QWEN3_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_DEEPSEEK_V3_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\s*```(?:json)?\s*(?P<args>.*?)\s*```\s*<｜tool▁call▁end｜>",
    re.S,
)


def _content(text: str, start: int) -> str | None:
    return text[:start].strip() or None


# ---------------------------------------------------------------------- mistral
def parse_mistral(text: str) -> tuple[str | None, Calls]:
    start = text.find(MISTRAL_MARKER)
    if start < 0:
        return text, []
    body = text[start:]
    calls: Calls = []
    for segment in body.split(MISTRAL_MARKER)[1:]:
        segment = segment.strip()
        if not segment:
            continue
        if segment.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
            try:
                items = json.loads(segment)
            except ValueError:
                return text, []
            for item in items if isinstance(items, list) else []:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    return text, []
                calls.append((item["name"], item.get("arguments", {})))
            continue
        name, sep, arguments = segment.partition(MISTRAL_ARGS)  # name[ARGS]{...}
        if not sep:
            name, brace, rest = segment.partition("{")  # name{...}, as some checkpoints write it
            if not brace:
                return text, []
            arguments = brace + rest
        try:
            calls.append((name.strip(), json.loads(arguments)))
        except ValueError:
            return text, []
    if not calls or not all(name for name, _ in calls):
        return text, []
    return _content(text, start), calls


# ---------------------------------------------------------------------- pythonic
def parse_pythonic(text: str) -> tuple[str | None, Calls]:
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :]
        if body.endswith(PYTHON_END):
            body = body[: -len(PYTHON_END)]
        body = body.strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return text, []
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls: Calls = []
    for element in tree.elts:
        if not isinstance(element, ast.Call) or not isinstance(element.func, ast.Name) or element.args:
            return text, []
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in element.keywords if kw.arg is not None}
        except ValueError:
            return text, []
        if len(arguments) != len(element.keywords):
            return text, []  # **kwargs
        calls.append((element.func.id, arguments))
    return None, calls


# ---------------------------------------------------------------------- qwen3_coder
def _parameter_types(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        function = tool.get("function", {})
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the JSON type its schema names (text stays text when
    it does not convert)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if value.lower() == "null" and "string" not in kinds:
        return None
    if "string" in kinds:
        return value
    try:
        if kinds & {"integer"} and re.fullmatch(r"[-+]?\d+", value):
            return int(value)
        if kinds & {"number", "integer"}:
            number = float(value)
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if "boolean" in kinds:
            return {"true": True, "false": False}.get(value.lower(), value)
        return json.loads(value)  # object, array, or no declared type
    except ValueError:
        try:
            return ast.literal_eval(value) if kinds & {"object", "array"} else value
        except (ValueError, SyntaxError):
            return value


def parse_qwen3_coder(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, Calls]:
    start = text.find(QWEN3_CODER_MARKER)
    if start < 0:
        start = text.find("<function=")
        if start < 0:
            return text, []
    calls: Calls = []
    for function in _QWEN3_FUNCTION.finditer(text, start):
        name = function.group(1).strip()
        types = _parameter_types(tools, name)
        arguments = {}
        for parameter in _QWEN3_PARAMETER.finditer(function.group(2)):
            key = parameter.group(1).strip()
            value = parameter.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            arguments[key] = _typed(value, types.get(key))
        calls.append((name, arguments))
    if not calls:
        return text, []
    return _content(text, start), calls


# ---------------------------------------------------------------------- deepseek_v3
def parse_deepseek_v3(text: str) -> tuple[str | None, Calls]:
    start = text.find(DEEPSEEK_V3_MARKER)
    if start < 0:
        return text, []
    calls: Calls = []
    for match in _DEEPSEEK_V3_CALL.finditer(text, start):
        try:
            calls.append((match.group("name").strip(), json.loads(match.group("args"))))
        except ValueError:
            return text, []
    if not calls:
        return text, []
    return _content(text, start), calls
