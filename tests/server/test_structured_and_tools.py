"""Structured outputs, tools, logit_bias, echo-only scoring and unknown-field refusal over HTTP,
through the official ``openai`` client where it applies; the playground and offline /docs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.server.app import create_app
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint
from tests.server.conftest import RunningServer, host_config, serve

# A Hermes / Qwen style template: tools in the system turn, calls as <tool_call> JSON, tool
# results as <tool_response>.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    '{"name": "{{ c["function"]["name"] }}", "arguments": {{ c["function"]["arguments"] | tojson }}}'
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 8},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "meta": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "code": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["ok", "code"],
        },
    },
    "required": ["title", "rating", "tags", "meta"],
}
PARAMS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    path = save_tiny_checkpoint(make_tiny_model("LlamaForCausalLM", seed=0), tmp_path_factory.mktemp("tools"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    host = AsyncEngine(build_engines([ModelSpec("tiny", str(path))], host_config(max_model_len=512)))
    with serve(create_app(host)) as url:
        yield RunningServer(url, None, host)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


USER = [{"role": "user", "content": "The weather in Paris?"}]


# ---------------------------------------------------------------------- structured outputs
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema_validates(client, temperature):
    result = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=200,
        temperature=temperature,
        seed=5,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}},
    )
    for choice in result.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_guided_json_and_json_object_on_completions(client):
    stream = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=200,
        stream=True,
        temperature=0.8,
        seed=1,
        extra_body={"guided_json": SCHEMA},
    )
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), SCHEMA)
    result = client.completions.create(
        model="tiny",
        prompt="y",
        max_tokens=100,
        temperature=0.8,
        seed=2,
        extra_body={"response_format": {"type": "json_object"}},
    )
    # Any JSON object: keys are free strings, which a random model may never close, so only a
    # finished answer must parse; a cut one must still be an object's beginning.
    text = result.choices[0].text
    assert text.startswith("{")
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    result = client.completions.create(
        model="tiny",
        prompt="z",
        max_tokens=10,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert result.choices[0].text in ("left", "right")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"guided_json": {"type": "object", "properties": {"a": {"minimum": "low"}}}}, "guided_json"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"frobnicate": 1}, "frobnicate"),
        (
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"stream_options": {"include_usage": True, "shiny": True}}, "stream_options.shiny"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        # The audit's hostile constraints (issue 31): 400 naming the field, never a 500 or a stall.
        ({"logit_bias": {str(i): 1 for i in range(100_000)}}, "logit_bias"),
        ({"guided_json": {"enum": [f"v{i}" for i in range(100_000)]}}, "guided_json"),
        ({"guided_json": "[" * 100_000 + "]" * 100_000}, "guided_json"),
        ({"guided_json": {"type": "string", "pattern": "(" * 5000 + "a" + ")" * 5000}}, "guided_json"),
        ({"guided_regex": "(" * 100 + "a" + ")" * 100}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "guided_json"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_bad_requests_name_the_field(server, body, param):
    response = _post(server, "/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "BadRequestError"


def test_unknown_message_field_is_refused(server):
    messages = [{"role": "user", "content": "hi", "audio": {"id": "x"}}]
    response = _post(server, "/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.audio"


# ---------------------------------------------------------------------- logit_bias and echo
def test_logit_bias_moves_greedy_choice(client):
    plain = client.completions.create(
        model="tiny", prompt="The cat", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    forced = client.completions.create(
        model="tiny",
        prompt="The cat",
        max_tokens=6,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text != plain.choices[0].text
    tokens = client.completions.create(
        model="tiny",
        prompt="The cat",
        max_tokens=6,
        temperature=0,
        logit_bias={"42": 100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert len(set(tokens.choices[0].logprobs.tokens)) == 1  # the same token every time


def test_echo_with_max_tokens_zero_scores_the_prompt(client):
    prompt = "The quick brown fox"
    result = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = result.choices[0]
    assert choice.text == prompt
    assert result.usage.completion_tokens == 0 and result.usage.total_tokens == result.usage.prompt_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == result.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


# ---------------------------------------------------------------------- tools
def test_required_tool_call_round_trip(client):
    first = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=200,
        temperature=0.9,
        seed=3,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    # The assistant's calls and the tool's answer go back in: accepted and rendered.
    messages = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp": 21}'},
    ]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=5)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_named_tool_call_and_streaming_deltas(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=100, temperature=0
    )
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])

    for choice_arg in (named, "required"):
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=USER,
                tools=[WEATHER, CLOCK],
                tool_choice=choice_arg,
                max_tokens=200,
                temperature=0,
                stream=True,
            )
        )
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
        assert deltas and deltas[0].id and deltas[0].function.name  # id and name come first
        calls: dict[int, dict] = {}
        for d in deltas:
            entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.function.name:
                entry["name"] = d.function.name
            entry["arguments"] += d.function.arguments or ""
        for entry in calls.values():
            jsonschema.validate(json.loads(entry["arguments"]), PARAMS[entry["name"]])
        if choice_arg == named:
            assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)  # same greedy output
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop" if choice_arg == named else "tool_calls"]


def test_tool_choice_none_and_auto_answer_with_text(client):
    for choice in ("none", "auto"):
        result = client.chat.completions.create(
            model="tiny", messages=USER, tools=[WEATHER], tool_choice=choice, max_tokens=8, temperature=0
        )
        assert result.choices[0].message.tool_calls is None
        assert isinstance(result.choices[0].message.content, str)


# ---------------------------------------------------------------------- playground and docs
def test_playground_and_stats(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and "qserve playground" in page.text
    for asset in ("app.js", "style.css"):
        assert httpx.get(f"{server.url}/ui/static/{asset}").status_code == 200
    assert "http" not in page.text.replace("http-equiv", "")  # nothing from elsewhere
    stats = httpx.get(f"{server.url}/ui/stats").json()
    (model,) = stats["models"]
    assert model["name"] == "tiny" and model["pages_total"] > 0
    assert {"pages_used", "pages_free", "running", "waiting", "tokens_per_s", "generated_tokens"} <= set(model)


def test_docs_are_served_without_a_cdn(server):
    docs = httpx.get(f"{server.url}/docs")
    assert docs.status_code == 200
    assert "cdn" not in docs.text.lower() and "/_docs_static/swagger-ui-bundle.js" in docs.text
    assert httpx.get(f"{server.url}/_docs_static/swagger-ui-bundle.js").status_code == 200
    redoc = httpx.get(f"{server.url}/redoc")
    assert redoc.status_code == 200 and "cdn" not in redoc.text.lower() and "fonts.googleapis" not in redoc.text


def test_no_ui_turns_the_page_off(server):
    app = create_app(server.host, ui=False)
    paths = {getattr(route, "path", None) for route in app.routes}
    assert "/" not in paths and "/ui/stats" not in paths and "/docs" in paths
