"""Tool calling: what ``tools`` / ``tool_choice`` ask of the model, and how its text becomes
OpenAI ``tool_calls`` (whole, or as streaming deltas).

Knows: OpenAI's tool semantics (``none``: no calls; ``auto``: the model decides, its text is
parsed; ``required``: at least one call; a named function: exactly that call), how forced
calls are enforced with a JSON schema (the structured-output machinery, so they always parse:
``required`` -> a JSON array of ``{"name", "parameters"}``, a named function -> its parameters
object, as vLLM does), the two text formats parsed in ``auto`` mode (Hermes / Qwen
``<tool_call>{"name", "arguments"}</tool_call>`` and Llama 3's bare JSON ``{"name",
"parameters"}``, optionally after ``<|python_tag|>``), and how chat messages carrying tool
calls and tool results are handed to a chat template. Must not know: the engine, HTTP.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from qserve.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from qserve.server.structured import ConstraintError
from qserve.structured.params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.S)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect_parser(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches: Llama 3 if it mentions ``<|python_tag|>``
    or Llama's ``"parameters"`` calls without ``<tool_call>``; Hermes / Qwen otherwise."""
    template = chat_template or ""
    if TOOL_CALL_START not in template and (PYTHON_TAG in template or '"parameters"' in template):
        return "llama3_json"
    return "hermes"


@dataclass
class ToolPlan:
    """What one chat request does with tools."""

    mode: str  # "none" | "auto" | "required" | "named"
    template_tools: list[dict[str, Any]] | None = None  # handed to the chat template
    named: str | None = None
    constraint: StructuredOutputsParams | None = None  # for "required" / "named"
    names: list[str] = field(default_factory=list)
    parallel: bool = True  # parallel_tool_calls: False keeps only the first call

    @property
    def parses_calls(self) -> bool:
        return self.mode in ("auto", "required", "named")


def plan_tools(request: ChatCompletionRequest) -> ToolPlan:
    """Read ``tools`` / ``tool_choice``; ConstraintError naming the field if they do not fit."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise ConstraintError("tool_choice needs tools: the request defines none", "tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ConstraintError(f"tools must have unique function names, got {names}", "tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice is None or choice == "auto":
        return ToolPlan("auto", template_tools, names=names, parallel=request.parallel_tool_calls)
    if choice == "none":
        return ToolPlan("none", None, names=names)  # as OpenAI: the model is not told about tools
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t.function.parameters)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not request.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(
            "required",
            template_tools,
            constraint=StructuredOutputsParams(json=schema),
            names=names,
            parallel=request.parallel_tool_calls,
        )
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise ConstraintError(
            f"tool_choice names function {name!r}, which is not among the tools {names}", "tool_choice"
        )
    constraint = StructuredOutputsParams(json=_parameters(tool.function.parameters))
    return ToolPlan("named", template_tools, named=name, constraint=constraint, names=names)


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return schema if schema else {"type": "object", "properties": {}}


# ---------------------------------------------------------------------- messages for the template
def template_message(message: ChatMessage) -> dict[str, Any]:
    """A chat message as HF chat templates read it (tool-call arguments as objects, as the
    Hermes / Qwen and Llama 3 templates expect)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            calls.append(
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
            )
        out["tool_calls"] = calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


# ---------------------------------------------------------------------- parsing whole outputs
def _call(name: Any, arguments: Any) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        text = arguments
    else:
        text = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """``auto`` mode: (content, calls) from the model's text in the ``parser`` format.
    Text that is not a well-formed call stays content."""
    if parser == "llama3_json":
        return _parse_llama3(text)
    calls: list[ToolCall] = []
    for match in _HERMES_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            continue
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = text[: text.find(TOOL_CALL_START)].strip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except ValueError:
            return text, []
        if not isinstance(obj, dict):
            return text, []
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
        if call is None:
            return text, []
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
    return None, calls


def parse_forced(text: str, plan: ToolPlan) -> list[ToolCall]:
    """``required`` / named: the output was constrained to the plan's schema, so it parses
    (unless it was cut by max_tokens: then no calls)."""
    if plan.mode == "named":
        return [ToolCall(id=new_call_id(), function=FunctionCall(name=plan.named or "", arguments=text))]
    try:
        items = json.loads(text)
    except ValueError:
        return []
    calls = [_call(item.get("name"), item.get("parameters")) for item in items if isinstance(item, dict)]
    return [c for c in calls if c is not None]


# ---------------------------------------------------------------------- streaming
@dataclass
class StreamEvent:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallStreamer:
    """Streaming ``auto`` mode: content passes through as it comes, except text that is (or
    may become) a tool call, which is held until the call is complete and then released as a
    ``ToolCall``. Feed the text deltas, then ``finish()``."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self._pending = ""  # text not yet released
        self._in_call = False  # inside <tool_call> ... (hermes) or a JSON call (llama3)
        self._seen_content = False
        self.num_calls = 0

    def feed(self, delta: str) -> StreamEvent:
        self._pending += delta
        return self._drain(final=False)

    def finish(self) -> StreamEvent:
        return self._drain(final=True)

    def _drain(self, final: bool) -> StreamEvent:
        event = StreamEvent()
        if self.parser == "llama3_json":
            return self._drain_llama3(event, final)
        while self._pending:
            if self._in_call:
                end = self._pending.find(TOOL_CALL_END)
                if end < 0 and not final:
                    break
                block = self._pending if end < 0 else self._pending[: end + len(TOOL_CALL_END)]
                self._pending = "" if end < 0 else self._pending[end + len(TOOL_CALL_END) :]
                _, calls = parse_tool_calls(TOOL_CALL_START + block, "hermes")
                if calls:
                    event.calls.extend(calls)
                else:
                    event.content += TOOL_CALL_START + block  # not a well-formed call: it was text
                self._in_call = False
                continue
            start = self._pending.find(TOOL_CALL_START)
            if start >= 0:
                event.content += self._pending[:start]
                self._pending = self._pending[start + len(TOOL_CALL_START) :]
                self._in_call = True
                continue
            keep = 0 if final else _partial_suffix(self._pending, TOOL_CALL_START)
            event.content += self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep :]
            break
        self.num_calls += len(event.calls)
        return event

    def _drain_llama3(self, event: StreamEvent, final: bool) -> StreamEvent:
        if not self._seen_content and not self._in_call:
            head = self._pending.lstrip()
            if not head:
                return event
            if head.startswith("{") or head.startswith(PYTHON_TAG) or (not final and PYTHON_TAG.startswith(head)):
                self._in_call = True
            else:
                self._seen_content = True
        if self._seen_content:
            event.content, self._pending = self._pending, ""
            return event
        if final:
            content, calls = _parse_llama3(self._pending)
            event.calls, event.content = calls, content or ""
            self._pending = ""
            self.num_calls += len(calls)
        return event


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
