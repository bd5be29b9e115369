"""Fast unit tests: the batched bitmask op against a per-bit reference, logit_bias and masks in
the sampler, tool-call parsing (whole and streamed), constraint resolution, the tok/s meter."""

from __future__ import annotations

import json

import pytest
import torch

from qserve.runner.sampler import Sampler, apply_token_bitmask, build_sampling_metadata
from qserve.sampling_params import SamplingParams
from qserve.server.playground import ThroughputMeter
from qserve.server.protocol import ChatCompletionRequest, CompletionRequest
from qserve.server.structured import ConstraintError, constraint_of
from qserve.server.tools import ToolCallStreamer, detect_parser, parse_tool_calls, plan_tools
from qserve.structured.schema_rewrite import rewrite_schema


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF if t // 32 < bitmask.shape[1] else 0
            if not (word >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize(("rows", "vocab", "words"), [(1, 5, 1), (3, 70, 3), (4, 64, 2), (2, 100, 3), (2, 90, 2)])
def test_apply_token_bitmask_matches_reference(rows, vocab, words):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    bitmask[0, 0] = -1  # all allowed in the first word
    expected = _reference_mask(logits, bitmask)
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), expected)


def test_sampler_masks_only_constrained_rows_and_adds_logit_bias():
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [7, 33]
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
    ]
    for row in (0, 1):  # the constrained row is greedy, then sampled
        md = build_sampling_metadata(
            params, [[1]] * 3, [[]] * 3, [0], vocab, "cpu", token_bitmask=([row], bitmask.numpy())
        )
        tokens, _ = Sampler(0)(logits, md)
        assert tokens[row] in allowed
        assert tokens[2] == 5  # +100 wins the argmax
        if row == 1:
            assert tokens[0] == int(logits[0].argmax())  # the unconstrained greedy row is untouched
    for seed in range(20):  # sampled constrained rows never leave the mask
        md = build_sampling_metadata(
            [SamplingParams(temperature=2.0, seed=seed)],
            [[1]],
            [[]],
            [0],
            vocab,
            "cpu",
            token_bitmask=([0], bitmask.numpy()),
        )
        assert Sampler(seed)(logits[1:2], md)[0][0] in allowed


def test_logit_bias_validation():
    assert SamplingParams(logit_bias={"3": -2}).logit_bias == {3: -2.0}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})


def test_string_lengths_become_safe_patterns():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "string", "pattern": "x"}},
    }
    out = rewrite_schema(schema)
    assert out["properties"]["a"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\\\ud800-\\udfff]{0,3}$'}
    assert out["properties"]["b"] == {"type": "string", "pattern": "x"}
    assert schema["properties"]["a"] == {"type": "string", "maxLength": 3}  # the input is not changed


# ---------------------------------------------------------------------- tool parsing
def test_hermes_calls_parse_and_bad_ones_stay_text():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "t", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me check."
    assert [c.function.name for c in calls] == ["get_weather", "t"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", "hermes") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls("plain answer", "hermes") == ("plain answer", [])


def test_llama3_json_calls_parse():
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "llama3_json"
    )
    assert content is None and [c.function.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].function.arguments) == {"x": 1}
    assert parse_tool_calls('{"x": 1}', "llama3_json") == ('{"x": 1}', [])
    assert parse_tool_calls("Hi there", "llama3_json") == ("Hi there", [])


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_streaming_parser_matches_whole_parse(parser):
    if parser == "hermes":
        text = 'Sure.<tool_call>{"name": "a", "arguments": {"k": "v"}}</tool_call> <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    else:
        text = '{"name": "a", "parameters": {"k": "v"}}; {"name": "b", "parameters": {}}'
    for step in (1, 3, 7):
        streamer = ToolCallStreamer(parser)
        content, calls = "", []
        for i in range(0, len(text), step):
            event = streamer.feed(text[i : i + step])
            assert "<tool" not in event.content  # tags are never streamed as content
            content += event.content
            calls += event.calls
        tail = streamer.finish()
        content += tail.content
        calls += tail.calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("a", {"k": "v"}), ("b", {})]
        assert content.strip() == ("Sure." if parser == "hermes" else "")


def test_streaming_hermes_passes_plain_text_and_partial_tags():
    streamer = ToolCallStreamer("hermes")
    assert streamer.feed("a <tool").content == "a "
    assert streamer.feed("box> b").content == "<toolbox> b"  # not a tag after all
    assert streamer.finish().content == ""


def test_detect_parser():
    assert detect_parser("{{ '<tool_call>' }}") == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }} \"parameters\"") == "llama3_json"
    assert detect_parser(None) == "hermes"


def test_plan_tools_and_constraints():
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    plan = plan_tools(ChatCompletionRequest(**base, tool_choice="required", parallel_tool_calls=False))
    assert plan.mode == "required" and plan.constraint.schema()["maxItems"] == 1
    named = plan_tools(ChatCompletionRequest(**base, tool_choice={"type": "function", "function": {"name": "f"}}))
    assert named.constraint.schema() == tool["function"]["parameters"]
    assert plan_tools(ChatCompletionRequest(**base, tool_choice="none")).template_tools is None
    with pytest.raises(ConstraintError) as err:
        plan_tools(ChatCompletionRequest(model="m", messages=base["messages"], tool_choice="auto"))
    assert err.value.field == "tool_choice"
    params, field = constraint_of(CompletionRequest(model="m", prompt="x", guided_choice=["a", "b"]))
    assert params.choice == ["a", "b"] and field == "guided_choice"
    assert constraint_of(CompletionRequest(model="m", prompt="x", response_format={"type": "text"})) == (None, None)


def test_throughput_meter():
    meter = ThroughputMeter(window_s=2.0)
    assert meter.rate("m", 0, now=0.0) == 0.0
    assert meter.rate("m", 10, now=1.0) == pytest.approx(10.0)
    assert meter.rate("m", 30, now=2.0) == pytest.approx(15.0)
    assert meter.rate("m", 30, now=5.0) == pytest.approx(0.0, abs=7.0)  # old samples age out
    assert meter.rate("m", 30, now=9.0) == pytest.approx(0.0)


def test_serving_tool_stream_auto_and_whole_message():
    from qserve.server.serving import OpenAIServing, ServedModel, _ToolStream

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool])
    plan = plan_tools(request)
    text = 'ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    stream = _ToolStream(plan, "hermes")
    content, deltas = "", []
    for i in range(0, len(text), 4):
        piece, new = stream.feed(text[i : i + 4], finishing=i + 4 >= len(text))
        content += piece
        deltas += new
    assert content == "ok "
    assert deltas[0].id and deltas[0].function.name == "f" and deltas[0].function.arguments == ""
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"a": 1}
    assert {d.index for d in deltas} == {0} and stream.num_calls == 1

    model = ServedModel(name="m", path="p", max_model_len=8, vocab_size=8, tokenizer=None)
    message, finish = OpenAIServing._chat_message(model, plan, text, "stop")
    assert finish == "tool_calls" and message.content == "ok" and message.tool_calls[0].function.name == "f"
    two = text + '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>'
    assert len(OpenAIServing._chat_message(model, plan, two, "stop")[0].tool_calls) == 2
    single = plan_tools(request.model_copy(update={"parallel_tool_calls": False}))
    (only,) = OpenAIServing._chat_message(model, single, two, "stop")[0].tool_calls
    assert json.loads(only.function.arguments) == {"a": 1}
    single_stream = _ToolStream(single, "hermes")
    _, deltas = single_stream.feed(two, finishing=True)
    assert {d.index for d in deltas} == {0} and single_stream.num_calls == 1
    message, finish = OpenAIServing._chat_message(model, plan, "just text", "stop")
    assert finish == "stop" and message.content == "just text" and message.tool_calls is None
