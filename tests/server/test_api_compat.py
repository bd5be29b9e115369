"""What OpenAI and vLLM clients send today is accepted (issue 28): the newer request fields
(``reasoning_effort`` honoured through the chat template's thinking switch), CORS, and tool
calls cut by ``max_tokens``. In-process (``TestClient``) against a tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.server.app import create_app
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint
from tests.server.conftest import host_config

# A Qwen3-style template: with enable_thinking false the assistant turn opens with an empty
# think block (as Qwen3's template does); tools are listed in a system turn.
THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
USER = [{"role": "user", "content": "The weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = save_tiny_checkpoint(make_tiny_model("LlamaForCausalLM", seed=0), tmp_path_factory.mktemp("compat"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    return str(path)


@pytest.fixture(scope="module")
def client(checkpoint) -> Iterator[TestClient]:
    host = AsyncEngine(build_engines([ModelSpec("tiny", checkpoint)], host_config(max_model_len=512)))
    with TestClient(create_app(host, log_stats=False)) as test_client:
        yield test_client


def chat(client: TestClient, **body) -> dict:
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, **body})
    assert response.status_code == 200, response.text
    return response.json()


# ---------------------------------------------------------------------- accepted fields
NEW_FIELDS = {
    "store": False,
    "metadata": {"team": "search"},
    "service_tier": "auto",
    "reasoning_effort": "low",
    "modalities": ["text"],
    "prompt_cache_key": "user-42",
    "verbosity": "low",
    "safety_identifier": "hash-123",
    "user": "u1",
    "parallel_tool_calls": False,
    "priority": 5,
    "guided_decoding_backend": "xgrammar",
}


@pytest.mark.parametrize("field", sorted(NEW_FIELDS))
def test_current_openai_and_vllm_fields_are_accepted(client, field):
    reply = chat(client, max_tokens=2, **{field: NEW_FIELDS[field]})
    assert reply["choices"][0]["message"]["role"] == "assistant"


def test_vllm_fields_are_accepted_on_completions(client):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "priority": -1, "guided_decoding_backend": "auto"}
    assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities.1"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"service_tier": "gold"}, "service_tier"),
    ],
)
def test_values_qserve_cannot_honour_are_refused(client, body, param):
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2, **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_reasoning_effort_switches_the_templates_thinking(client):
    def prompt_tokens(**body) -> int:
        return chat(client, max_tokens=1, **body)["usage"]["prompt_tokens"]

    plain = prompt_tokens()
    assert prompt_tokens(reasoning_effort="high") == plain  # thinking on: the template's default
    no_think = prompt_tokens(reasoning_effort="none")
    assert no_think > plain  # the empty think block closes thinking
    assert prompt_tokens(reasoning_effort="minimal") == no_think
    # The request's own chat_template_kwargs win over reasoning_effort.
    assert prompt_tokens(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == plain


# ---------------------------------------------------------------------- CORS
def _cors_app(cors):
    def no_model():
        raise ValueError("no model in this test")

    return create_app(host_factory=no_model, api_key="k", cors=cors, log_stats=False, on_load_failed=lambda err: None)


def test_cors_preflight_is_answered_without_the_key_and_errors_carry_the_headers():
    from qserve.server.cors import CorsConfig

    cors = CorsConfig(allowed_origins=["https://a.example"])
    with TestClient(_cors_app(cors)) as client:
        preflight = {
            "Origin": "https://a.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        reply = client.options("/v1/chat/completions", headers=preflight)
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == "https://a.example"
        assert "POST" in reply.headers["access-control-allow-methods"]
        assert "access-control-allow-credentials" not in reply.headers  # vLLM's default: no credentials
        refused = client.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        # A page must be able to read the error of a request without the key.
        unauthorized = client.post("/v1/models", headers={"Origin": "https://a.example"})
        assert unauthorized.status_code == 401
        assert unauthorized.headers["access-control-allow-origin"] == "https://a.example"


def test_cors_wildcard_default_answers_any_origin():
    from qserve.server.cors import CorsConfig

    with TestClient(_cors_app(CorsConfig())) as client:
        headers = {"Origin": "https://b.example", "Access-Control-Request-Method": "POST"}
        reply = client.options("/v1/completions", headers=headers)
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"
    with TestClient(_cors_app(None)) as client:  # no CORS configured: the preflight is refused (the key)
        reply = client.options("/v1/completions", headers=headers)
        assert reply.status_code == 401 and "access-control-allow-origin" not in reply.headers


# ---------------------------------------------------------------------- tool calls cut by max_tokens
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
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
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_call_cut_by_max_tokens_is_length_without_half_json(client):
    reply = chat(client, tools=[WEATHER], tool_choice=NAMED, max_tokens=3, temperature=0)
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"] is None
    whole = chat(client, tools=[WEATHER], tool_choice=NAMED, max_tokens=200, temperature=0)["choices"][0]
    (call,) = whole["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]).keys() == {"city", "days"}


def test_a_required_call_cut_by_max_tokens_puts_no_raw_json_in_content(client):
    reply = chat(client, tools=[WEATHER], tool_choice="required", max_tokens=4, temperature=0)
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"] is None


def _stream_tool_deltas(client, **body) -> tuple[list[dict], str | None]:
    payload = {"model": "tiny", "messages": USER, "tools": [WEATHER], "stream": True, "temperature": 0, **body}
    deltas, finish = [], None
    with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                deltas += choice["delta"].get("tool_calls") or []
                finish = choice.get("finish_reason") or finish
    return deltas, finish


def test_a_streamed_required_call_streams_its_arguments_as_they_are_generated(client):
    deltas, finish = _stream_tool_deltas(client, tool_choice="required", max_tokens=200)
    assert finish == "tool_calls"
    assert deltas[0]["id"] and deltas[0]["function"]["name"] == "get_weather"
    first_call = [d for d in deltas if d["index"] == 0]
    argument_pieces = [d["function"]["arguments"] for d in first_call[1:]]
    assert len(argument_pieces) > 3  # piece by piece, not one delta at the end
    assert json.loads("".join(argument_pieces)).keys() == {"city", "days"}
    # Cut short: the arguments so far were streamed, and the stream says it was cut.
    whole = chat(client, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0)
    cut = whole["usage"]["completion_tokens"] - 3  # inside the arguments
    deltas, finish = _stream_tool_deltas(client, tool_choice="required", max_tokens=cut)
    assert finish == "length" and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas[1:]).startswith("{")


# ---------------------------------------------------------------------- metrics
def test_metrics_have_vllm_v1_request_phases_and_no_created_series(client):
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, float]:
        text = client.get("/metrics").text
        assert "_created" not in text  # vLLM turns the *_created series off
        return {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.labels.get("model_name") == "tiny" and "le" not in s.labels
        }

    before = samples()
    chat(client, max_tokens=4, n=2, temperature=1.0)
    after = samples()
    for name in ("prefill", "decode", "inference"):
        key = f"vllm:request_{name}_time_seconds_count"
        assert after[key] == before.get(key, 0) + 1, key
    assert after["vllm:request_params_n_sum"] - before.get("vllm:request_params_n_sum", 0) == 2
    assert after["vllm:request_params_max_tokens_sum"] - before.get("vllm:request_params_max_tokens_sum", 0) == 4
    steps = after["vllm:iteration_tokens_total_count"] - before.get("vllm:iteration_tokens_total_count", 0)
    tokens = after["vllm:iteration_tokens_total_sum"] - before.get("vllm:iteration_tokens_total_sum", 0)
    assert steps >= 4 and tokens >= steps  # a prefill step, then a decode step per token (2 sequences)
    inference = after["vllm:request_inference_time_seconds_sum"] - before.get(
        "vllm:request_inference_time_seconds_sum", 0
    )
    decode = after["vllm:request_decode_time_seconds_sum"] - before.get("vllm:request_decode_time_seconds_sum", 0)
    assert 0 <= decode <= inference
    lora = next(
        f for f in text_string_to_metric_families(client.get("/metrics").text) if f.name == "vllm:lora_requests_info"
    )
    (sample,) = lora.samples
    assert sample.labels["running_lora_adapters"] == "" and sample.labels["waiting_lora_adapters"] == ""
