"""vLLM's ``mistral``, ``pythonic``, ``qwen3_coder`` and ``deepseek_v3`` tool-call formats
(hand-written model outputs, whole and streamed), and forced (``required`` / named) output
cut by ``max_tokens``."""

from __future__ import annotations

import json

import pytest

from qserve.server.tools import (
    ForcedCallStreamer,
    ToolCallStreamer,
    ToolPlan,
    detect_parser,
    parse_forced,
    parse_tool_calls,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                    "ratio": {"type": "number"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
WEATHER = ("get_weather", {"city": "Paris", "days": 2})
TIME = ("get_time", {})

# parser -> [(model output, expected content, expected calls)]
CASES = {
    "mistral": [
        (
            'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
            '{"name": "get_time", "arguments": {}}]',
            "Let me check.",
            [WEATHER, TIME],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}',
            None,
            [WEATHER, TIME],
        ),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=2), get_time()]', None, [WEATHER, TIME]),
        ("<|python_start|>[get_weather(city='Paris', days=2)]<|python_end|>", None, [WEATHER]),
    ],
    "qwen3_coder": [
        (
            "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
            "Checking.",
            [WEATHER, TIME],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n<parameter=metric>\nTrue\n"
            "</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
            "</function>\n</tool_call>",
            None,
            [("get_weather", {"city": "12", "metric": True, "hours": [1, 2], "ratio": 0.5})],  # typed by the schema
        ),
    ],
    "deepseek_v3": [
        (
            "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
            "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "Sure.",
            [WEATHER, TIME],
        ),
    ],
}
FLAT_CASES = [(parser, *case) for parser, cases in CASES.items() for case in cases]
# Outputs that look like a call but are not one: they stay content, whole.
NOT_CALLS = [
    ("mistral", "[TOOL_CALLS][{broken"),
    ("mistral", "No tools needed."),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[os.system('rm -rf /')]"),
    ("pythonic", "The list [a, b]"),
    ("qwen3_coder", "Just text <tool_call> then nothing"),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops\n```<｜tool▁call▁end｜>",
    ),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FLAT_CASES)
def test_whole_output(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, parser, TOOLS)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize(("parser", "text"), NOT_CALLS)
def test_text_that_is_not_a_call_stays_content(parser, text):
    assert parse_tool_calls(text, parser, TOOLS) == (text, [])


@pytest.mark.parametrize("chunk", [1, 5, 10_000])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), FLAT_CASES)
def test_streamed_output(parser, text, content, calls, chunk):
    streamer = ToolCallStreamer(parser, TOOLS)
    streamed, got = "", []
    for i in range(0, len(text), chunk):
        event = streamer.feed(text[i : i + chunk])
        streamed += event.content
        got += event.calls
    tail = streamer.finish()
    streamed += tail.content
    got += tail.calls
    assert streamed.strip() == (content or "")
    assert _calls(got) == calls


@pytest.mark.parametrize(("parser", "text"), NOT_CALLS)
def test_streamed_text_that_is_not_a_call_comes_back_whole(parser, text):
    streamer = ToolCallStreamer(parser, TOOLS)
    out = "".join(streamer.feed(ch).content for ch in text) + streamer.finish().content
    assert out == text and streamer.num_calls == 0


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{ '<tool_call>\\n<function=' }}{{ '<parameter=' }}", "qwen3_coder"),
        ("{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{ '<｜tool▁calls▁begin｜>' }}", "deepseek_v3"),
        ("{{ '<|python_start|>' }}", "pythonic"),
        ("{{ '<tool_call>' }}", "hermes"),
    ],
)
def test_the_parser_is_read_from_the_chat_template(template, parser):
    assert detect_parser(template) == parser


# ---------------------------------------------------------------------- forced calls cut by max_tokens
REQUIRED = ToolPlan("required")
NAMED = ToolPlan("named", named="get_weather")
ARRAY = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "get_time", "parameters": {}}]'


def test_cut_required_output_keeps_only_the_complete_calls():
    assert _calls(parse_forced(ARRAY, REQUIRED)) == [WEATHER, TIME]
    second_cut = ARRAY[: ARRAY.index("get_time") + 4]
    assert _calls(parse_forced(second_cut, REQUIRED)) == [WEATHER]
    assert parse_forced(ARRAY[:30], REQUIRED) == []
    assert parse_forced('[{"name":', REQUIRED) == []


def test_cut_named_output_is_no_call():
    assert parse_forced('{"tz":', NAMED) == []
    (call,) = parse_forced('{"city": "Paris", "days": 2}', NAMED)
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == WEATHER[1]


@pytest.mark.parametrize("chunk", [1, 3, 10_000])
def test_required_output_streams_names_first_then_arguments_piecewise(chunk):
    streamer = ForcedCallStreamer()
    events = []
    for i in range(0, len(ARRAY), chunk):
        events += streamer.feed(ARRAY[i : i + chunk])
    names = {index: name for index, name, _ in events if name is not None}
    arguments: dict[int, str] = {}
    for index, _, piece in events:
        arguments[index] = arguments.get(index, "") + piece
    assert names == {0: "get_weather", 1: "get_time"}
    assert [json.loads(arguments[i]) for i in (0, 1)] == [WEATHER[1], TIME[1]]
    first_name = next(i for i, e in enumerate(events) if e[1] == "get_weather")
    assert all(not piece for _, _, piece in events[: first_name + 1])  # the name comes before any argument
    if chunk == 1:
        assert sum(1 for index, _, piece in events if index == 0 and piece) > 5  # piece by piece


def test_arguments_holding_braces_and_quotes_in_strings_are_streamed_whole():
    text = '[{"name": "f", "parameters": {"s": "a}\\"]{", "n": [1, {"x": 2}]}}]'
    streamer = ForcedCallStreamer()
    events = [e for ch in text for e in streamer.feed(ch)]
    assert json.loads("".join(piece for _, _, piece in events)) == {"s": 'a}"]{', "n": [1, {"x": 2}]}
