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
