"""``/v1/responses`` and ``/v1/embeddings`` through the official ``openai`` client, in process
(the client's HTTP goes through a ``TestClient`` on the ASGI app)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.server.app import create_app
from qserve.server.responses import ResponsesRequest, ResponseStore, StoredResponse, create_response
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint
from tests.server.conftest import host_config
from tests.server.test_structured_and_tools import HERMES_TEMPLATE

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[openai.OpenAI, TestClient, object, str]]:
    model = make_tiny_model("LlamaForCausalLM", seed=0)
    path = save_tiny_checkpoint(model, tmp_path_factory.mktemp("responses"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    host = AsyncEngine(build_engines([ModelSpec("tiny", str(path))], host_config(max_model_len=512)))
    with TestClient(create_app(host, log_stats=False)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        yield client, http, model, str(path)


# ---------------------------------------------------------------------- responses
def test_response_is_the_chat_answer_in_responses_shape(served):
    client = served[0]
    response = client.responses.create(
        model="tiny", input="Hello there", instructions="Answer briefly.", max_output_tokens=6, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    finish = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 6


def test_streamed_response_events(served):
    client = served[0]
    kwargs = {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}
    plain = client.responses.create(max_output_tokens=5, temperature=0, **kwargs)
    events = list(client.responses.create(max_output_tokens=5, temperature=0, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    final_type = "response.incomplete" if plain.status == "incomplete" else "response.completed"
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final_type,
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[-4].text == text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    assert events[0].response.status == "in_progress"


def test_function_tool_call_then_its_output_continues_the_conversation(served):
    client = served[0]
    choice = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, max_output_tokens=60
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tools[0].name == "get_weather"

    streamed = list(
        client.responses.create(
            model="tiny", input="Weather?", tools=[WEATHER], tool_choice=choice, max_output_tokens=60, stream=True
        )
    )
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments and json.loads(arguments)
    [item] = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert item.type == "function_call" and item.arguments == arguments
    assert streamed[-1].response.output[0].call_id == item.call_id

    follow = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=3,
    )
    assert follow.previous_response_id == first.id
    # the stored turn (question + call) is in the prompt: more tokens than the tool output alone
    assert follow.usage.input_tokens > first.usage.input_tokens


def test_input_items_replay_a_conversation(served):
    client = served[0]
    first = client.responses.create(model="tiny", input="One", max_output_tokens=3, temperature=0)
    chained = client.responses.create(
        model="tiny", input="Two", previous_response_id=first.id, max_output_tokens=3, temperature=0
    )
    replayed = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "One"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
            {"role": "user", "content": "Two"},
        ],
        max_output_tokens=3,
        temperature=0,
        store=False,
    )
    assert replayed.usage.input_tokens == chained.usage.input_tokens
    assert replayed.output_text == chained.output_text
    http = served[1]
    assert http.get(f"/v1/responses/{chained.id}").json()["output"][0]["content"][0]["text"] == chained.output_text
    assert http.get(f"/v1/responses/{replayed.id}").status_code == 404  # store=False
    assert http.delete(f"/v1/responses/{chained.id}").json()["deleted"] is True


def test_unknown_previous_response_is_a_404_naming_it(served):
    client = served[0]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert "resp_nope" in info.value.message and info.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format"),
        ({"truncation": "auto"}, "truncation"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_requests_name_the_field(served, body, param):
    response = served[1].post("/v1/responses", json={"model": "tiny", "input": "x", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param), error
    assert error["type"] == "BadRequestError"


def test_response_store_keeps_the_most_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2


# ---------------------------------------------------------------------- embeddings
def _reference(model, token_ids: list[int]) -> np.ndarray:
    """Last-token pooling of the final hidden state, L2-normalized, by transformers."""
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(hidden, dim=0).numpy()


def test_embeddings_of_strings_and_token_ids_match_transformers(served):
    client, _, model, path = served
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = ["The quick brown fox", "jumps"]
    result = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert result.object == "list" and result.model == "tiny" and [d.index for d in result.data] == [0, 1]
    ids = [tokenizer.encode(t) for t in texts]
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    for item, token_ids in zip(result.data, ids):
        np.testing.assert_allclose(item.embedding, _reference(model, token_ids), atol=1e-5)
    # token ids, one list and a list of lists; base64 (the client's default) decodes to the same floats
    single = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, result.data[0].embedding, atol=1e-5)
    encoded = client.embeddings.create(model="tiny", input=ids)
    for item, plain in zip(encoded.data, result.data):
        np.testing.assert_allclose(item.embedding, plain.embedding, atol=1e-6)


def test_embeddings_batched_equal_one_at_a_time(served):
    client = served[0]
    inputs = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41], [7] * 30]
    batched = client.embeddings.create(model="tiny", input=inputs, encoding_format="float")
    for item, token_ids in zip(batched.data, inputs):
        alone = client.embeddings.create(model="tiny", input=[token_ids], encoding_format="float")
        np.testing.assert_allclose(item.embedding, alone.data[0].embedding, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"dimensions": 8}, "dimensions"),
        ({"input": [[999999]]}, "input"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": "\ud800"}, "input"),
        ({"input": ["a"] * 1025}, "input"),
        ({"encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_embedding_requests_name_the_field(served, body, param):
    text = json.dumps({"model": "tiny", "input": "x", **body})  # ASCII: a lone surrogate as an escape
    response = served[1].post("/v1/embeddings", content=text.encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_dimensions_equal_to_the_hidden_size_is_accepted(served):
    client, _, model, _ = served
    size = model.config.hidden_size
    result = client.embeddings.create(model="tiny", input="hi", dimensions=size, encoding_format="float")
    assert len(result.data[0].embedding) == size


def test_closing_an_unread_stream_closes_the_chat_stream(served, monkeypatch):
    """A client gone before the first event: the chat stream (whose close aborts the engine
    request and frees its pages) is closed too."""
    http = served[1]
    serving = http.app.state.qserve.serving
    closed = []
    chat = serving.create_chat_completion

    async def spy(request, tenant=None):
        stream = await chat(request, tenant=tenant)
        close = stream.aclose

        async def aclose():
            closed.append(True)
            await close()

        stream.aclose = aclose
        return stream

    monkeypatch.setattr(serving, "create_chat_completion", spy)

    async def open_and_leave():
        body = ResponsesRequest(model="tiny", input="hi", stream=True, max_output_tokens=400)
        events = await create_response(serving, ResponseStore(), body, lambda chat_request: None)
        await events.aclose()

    http.portal.call(open_and_leave)
    assert closed == [True]
