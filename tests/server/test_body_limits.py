"""Large bodies never freeze the event loop (issue 31, item 3): what a JSON body holds is counted
off the loop and refused (400 naming the cap) before FastAPI and pydantic work through it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from qserve.server.body_gate import BodyLimitError, BodyLimits, check_body
from qserve.server.request_limits import RequestLimitError, check_text
from tests.server.test_errors import assert_error


@pytest.fixture(scope="module")
def http(two_model_server):
    with httpx.Client(base_url=two_model_server.url, timeout=60) as client:
        yield client


def post_json(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def test_health_stays_fast_while_a_body_of_400k_messages_is_refused(two_model_server):
    """14.8 MB of one-word messages (under the 16 MiB body limit): /health kept answering in
    ~20 ms instead of stalling 11 s while pydantic validated them on the loop."""
    body = {"model": "llama", "messages": [{"role": "user", "content": "word"}] * 400_000}
    data = json.dumps(body).encode()
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        result["r"] = httpx.post(
            f"{two_model_server.url}/v1/chat/completions",
            content=data,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )

    thread = threading.Thread(target=send)
    thread.start()
    worst = 0.0
    with httpx.Client(timeout=60) as client:
        while thread.is_alive():
            start = time.monotonic()
            assert client.get(f"{two_model_server.url}/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.01)
    thread.join()
    assert_error(result["r"], 400, None)
    assert "JSON values" in result["r"].json()["error"]["message"]
    # 20-60 ms when measured alone; before the body gate, 1.6-11 s. 1.0 s leaves room for a loaded
    # machine: 0.85 s was seen with two test suites and more sharing its two cores
    assert worst < 1.0, f"/health took {worst:.2f} s while a large body was handled"


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (
            "/v1/chat/completions",
            {"model": "llama", "messages": [{"role": "user", "content": "w"}] * 10_000},
            "messages",
            "at most 2048",
        ),
        ("/v1/completions", {"model": "llama", "prompt": [[1, 2]] * 10_000}, "prompt", "at most 256 are allowed"),
        (
            "/v1/completions",
            {"model": "llama", "prompt": [[1] * 2_100] * 130},
            "prompt",
            "273000 token ids in one request; at most 262144",
        ),
        ("/detokenize", {"model": "llama", "tokens": [1] * 270_000}, "tokens", "at most 262144"),
    ],
)
def test_counts_are_refused_before_per_item_work(http, path, body, param, words):
    start = time.monotonic()
    response = post_json(http, path, body)
    assert_error(response, 400, param)
    assert words in response.json()["error"]["message"]
    assert time.monotonic() - start < 10


def test_small_bodies_are_checked_by_the_routes_too(http):
    """Under the body gate's threshold the same message cap applies after parsing."""
    response = post_json(http, "/v1/chat/completions", {"model": "llama", "messages": [{"role": "user"}] * 2_100})
    assert_error(response, 400, "messages")
    assert "2100 messages in one request; at most 2048" in response.json()["error"]["message"]


def test_check_body_counts_and_passes_what_it_cannot_judge():
    limits = BodyLimits(max_json_values=50_000)
    with pytest.raises(BodyLimitError, match="more than 50000 JSON values"):
        check_body(json.dumps({"x": list(range(60_000))}).encode(), limits)
    check_body(json.dumps({"prompt": "a, [b {c" * 30_000}).encode(), limits)  # separators inside a string
    check_body(b"[" * 30_000 + b"not json", limits)  # the route reports invalid JSON
    check_body(json.dumps({"tokens": [1] * 40_000}).encode(), limits)


def test_text_check_finds_a_surrogate_deep_in_plain_json():
    """The C-speed pass over plain JSON values still names the field of a lone surrogate."""
    from pydantic import BaseModel

    class Model(BaseModel):
        chat_template_kwargs: dict

    request = Model(chat_template_kwargs={"a": [{"b": "ok"}] * 1000 + [{"c": "x\ud800"}]})
    with pytest.raises(RequestLimitError) as err:
        check_text(request)
    assert err.value.param == "chat_template_kwargs.a.1000.c"
    check_text(Model(chat_template_kwargs={"a": [1, 2, 3], "\u00e9": ["ok"] * 10}))
