"""Tool calling: what ``tools`` / ``tool_choice`` ask of the model, and how its text becomes
OpenAI ``tool_calls`` (whole, or as streaming deltas).

Knows: OpenAI's tool semantics (``none``: no calls; ``auto``: the model decides, its text is
parsed; ``required``: at least one call; a named function: exactly that call), how forced
calls are enforced with a JSON schema (the structured-output machinery, so they always parse:
``required`` -> a JSON array of ``{"name", "parameters"}``, a named function -> its parameters
object, as vLLM does), the text formats parsed in ``auto`` mode (Hermes / Qwen
``<tool_call>{"name", "arguments"}</tool_call>``, Llama 3's bare JSON ``{"name",
"parameters"}``, optionally after ``<|python_tag|>``, and vLLM's ``mistral``, ``pythonic``,
``qwen3_coder`` and ``deepseek_v3`` formats from ``tool_formats``), and how chat messages
carrying tool calls and tool results are handed to a chat template. Must not know: the
engine, HTTP.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from qserve.server import tool_formats
from qserve.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, ToolCall
from qserve.server.structured import ConstraintError
from qserve.structured.params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3")
# Formats whose call marker is a special token: the output must keep special tokens.
KEEP_SPECIAL_TOKENS = frozenset({"mistral"})
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.S)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect_parser(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches: Qwen3-Coder's XML calls, Mistral's
    ``[TOOL_CALLS]``, DeepSeek V3's markers, Llama 4's pythonic calls, Llama 3 if it mentions
    ``<|python_tag|>`` or Llama's ``"parameters"`` calls without ``<tool_call>``; Hermes / Qwen
    otherwise."""
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if tool_formats.MISTRAL_MARKER in template:
        return "mistral"
    if tool_formats.DEEPSEEK_V3_MARKER in template:
        return "deepseek_v3"
    if tool_formats.PYTHON_START in template:
        return "pythonic"
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


def parse_tool_calls(
    text: str, parser: str, tools: list[dict[str, Any]] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """``auto`` mode: (content, calls) from the model's text in the ``parser`` format
    (``tools``: the request's tools, which type qwen3_coder's parameters). Text that is not a
    well-formed call stays content."""
    if parser == "llama3_json":
        return _parse_llama3(text)
    if parser in _FORMATS:
        content, found = _FORMATS[parser](text, tools)
        calls = [c for c in (_call(name, arguments) for name, arguments in found) if c is not None]
        return (content, calls) if calls and len(calls) == len(found) else (text, [])
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


_FORMATS = {
    "mistral": lambda text, tools: tool_formats.parse_mistral(text),
    "pythonic": lambda text, tools: tool_formats.parse_pythonic(text),
    "qwen3_coder": tool_formats.parse_qwen3_coder,
    "deepseek_v3": lambda text, tools: tool_formats.parse_deepseek_v3(text),
}


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
    """``required`` / named: the complete calls of an output constrained to the plan's schema.
    Output cut by max_tokens keeps only the calls that were complete (a named call cut inside
    its arguments: none); half-written JSON never becomes a call."""
    if plan.mode == "named":
        try:
            arguments = json.loads(text)
        except ValueError:
            return []
        if not isinstance(arguments, dict):
            return []
        return [ToolCall(id=new_call_id(), function=FunctionCall(name=plan.named or "", arguments=text.strip()))]
    calls = [_call(item.get("name"), item.get("parameters")) for item in _complete_items(text)]
    return [c for c in calls if c is not None]


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The complete objects of a JSON array, also when the array itself was cut short."""
    decoder = json.JSONDecoder()
    position = _skip_space(text, 0)
    if not text.startswith("[", position):
        return []
    items = []
    position += 1
    while True:
        position = _skip_space(text, position)
        if text.startswith(",", position):
            position = _skip_space(text, position + 1)
        try:
            item, position = decoder.raw_decode(text, position)
        except ValueError:
            return items  # the end of the array, or an item cut short
        if isinstance(item, dict):
            items.append(item)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


class ForcedCallStreamer:
    """Streaming ``required``: the constrained output ``[{"name": ..., "parameters": {...}},
    ...]`` as it is generated: a call's name as soon as it is complete, then its arguments
    piece by piece. ``feed`` returns ``(call index, name or None, argument text)`` events."""

    _CLOSE = re.compile(r"\s*\}")
    _HEAD = re.compile(r'\s*(?:\[|,)?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*', re.S)

    def __init__(self) -> None:
        self._text = ""
        self._position = 0  # how far the text has been consumed
        self._in_arguments = False
        self._closing_call = False  # the arguments are complete; the call object's "}" is next
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.num_calls = 0

    def feed(self, delta: str) -> list[tuple[int, str | None, str]]:
        self._text += delta
        events: list[tuple[int, str | None, str]] = []
        while True:
            if self._closing_call:
                closing = self._CLOSE.match(self._text, self._position)
                if closing is None:
                    return events
                self._position = closing.end()
                self._closing_call = False
            if not self._in_arguments:
                match = self._HEAD.match(self._text, self._position)
                if match is None:
                    return events  # not yet (or the end of the array)
                self._position = match.end()
                self._in_arguments = True
                self._depth = 0
                events.append((self.num_calls, json.loads(f'"{match.group(1)}"'), ""))
                self.num_calls += 1
                continue
            start, end = self._scan_arguments()
            piece = self._text[start:end]
            if piece:
                events.append((self.num_calls - 1, None, piece))
            self._position = end
            if self._in_arguments:
                return events
            self._closing_call = True

    def _scan_arguments(self) -> tuple[int, int]:
        """Advance over the arguments value: (start, end) of the text read. Leaves
        ``_in_arguments`` when the value is complete."""
        text = self._text
        position = self._position
        if self._depth == 0:  # before the value: whitespace is not part of the arguments
            position = _skip_space(text, position)
        start = position
        while position < len(text):
            char = text[position]
            position += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._in_arguments = False
                    return start, position
        return start, position


# ---------------------------------------------------------------------- streaming
@dataclass
class StreamEvent:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallStreamer:
    """Streaming ``auto`` mode: content passes through as it comes, except text that is (or
    may become) a tool call, which is held until the call is complete and then released as a
    ``ToolCall``. Feed the text deltas, then ``finish()``."""

    def __init__(self, parser: str, tools: list[dict[str, Any]] | None = None) -> None:
        self.parser = parser
        self.tools = tools
        self._pending = ""  # text not yet released
        self._in_call = False  # inside <tool_call> ..., a leading call (llama3, pythonic), or after a marker
        self._seen_content = False
        self.num_calls = 0

    def feed(self, delta: str) -> StreamEvent:
        self._pending += delta
        return self._drain(final=False)

    def finish(self) -> StreamEvent:
        return self._drain(final=True)

    def _drain(self, final: bool) -> StreamEvent:
        event = StreamEvent()
        if self.parser in _LEADING_STARTS:
            return self._drain_leading(event, final)
        if self.parser in _MARKERS:
            return self._drain_marker(event, final)
        while self._pending:
            if self._in_call:
                end = self._pending.find(TOOL_CALL_END)
                if end < 0 and not final:
                    break
                block = self._pending if end < 0 else self._pending[: end + len(TOOL_CALL_END)]
                self._pending = "" if end < 0 else self._pending[end + len(TOOL_CALL_END) :]
                _, calls = parse_tool_calls(TOOL_CALL_START + block, self.parser, self.tools)
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

    def _drain_leading(self, event: StreamEvent, final: bool) -> StreamEvent:
        """Formats whose calls are the whole output (llama3_json, pythonic): held to the end."""
        if not self._seen_content and not self._in_call:
            head = self._pending.lstrip()
            if not head:
                return event
            bracket, tag = _LEADING_STARTS[self.parser]
            if head.startswith(bracket) or head.startswith(tag) or (not final and tag.startswith(head)):
                self._in_call = True
            else:
                self._seen_content = True
        if self._seen_content:
            event.content, self._pending = self._pending, ""
            return event
        if final:
            content, calls = parse_tool_calls(self._pending, self.parser, self.tools)
            event.calls, event.content = calls, content or ""
            self._pending = ""
            self.num_calls += len(calls)
        return event

    def _drain_marker(self, event: StreamEvent, final: bool) -> StreamEvent:
        """Formats whose calls follow a marker (mistral, deepseek_v3): content passes until the
        marker; from it on the text is held, and parsed at the end."""
        marker = _MARKERS[self.parser]
        if not self._in_call:
            start = self._pending.find(marker)
            if start >= 0:
                event.content += self._pending[:start]
                self._pending = self._pending[start:]
                self._in_call = True
            else:
                keep = 0 if final else _partial_suffix(self._pending, marker)
                event.content += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
        if self._in_call and final:
            content, calls = parse_tool_calls(self._pending, self.parser, self.tools)
            event.content += (content or "") if calls else self._pending
            event.calls.extend(calls)
            self._pending = ""
            self.num_calls += len(calls)
        return event


# Leading-call formats: (what a call opens with, its optional wrapper tag).
_LEADING_STARTS = {"llama3_json": ("{", PYTHON_TAG), "pythonic": ("[", tool_formats.PYTHON_START)}
_MARKERS = {"mistral": tool_formats.MISTRAL_MARKER, "deepseek_v3": tool_formats.DEEPSEEK_V3_MARKER}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
