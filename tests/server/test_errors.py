"""Every error comes back in OpenAI's shape with the right status, and never disturbs others."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from qserve.engine.async_engine import AsyncEngine, HostConfig, ModelSpec, build_engines
from qserve.server.app import create_app
from tests.server.conftest import MAX_MODEL_LEN, serve, wait_for


def assert_error(response: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] and error["code"] == status
    if param != "__any__":
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def http(two_model_server):
    with httpx.Client(base_url=two_model_server.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "top_k": -3}, "top_k"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"prompt": "word " * MAX_MODEL_LEN}, "prompt"),
        ({"prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ],
)
def test_completion_bad_parameters(http, body, param):
    error = assert_error(http.post("/v1/completions", json={"model": "llama", **body}), 400, param)
    assert error["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": MAX_MODEL_LEN},
            "max_completion_tokens",
        ),
    ],
)
def test_chat_bad_parameters(http, body, param):
    assert_error(http.post("/v1/chat/completions", json={"model": "qwen", **body}), 400, param)


def test_unknown_model_and_route_and_bad_json(http):
    error = assert_error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model")
    assert "nope" in error["message"]
    assert_error(
        http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404
    )
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)


def test_bad_requests_do_not_disturb_a_running_stream(http, two_model_server):
    body = {"model": "llama", "prompt": "Once", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    pieces = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        for bad in ({"prompt": [999999]}, {"prompt": "x", "temperature": -1}, {"prompt": "word " * MAX_MODEL_LEN}):
            assert http.post("/v1/completions", json={"model": "llama", **bad}).status_code == 400
        pieces = [line for line in lines if line.startswith("data: ")]
    assert pieces[-1] == "data: [DONE]"
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert full == expected
    pool = two_model_server.host.models["llama"].engine.block_pool
    assert wait_for(lambda: pool.num_used_blocks == 0)


def test_api_key_enforced(guarded_server):
    url = guarded_server.url
    body = {"model": "llama", "prompt": "x", "max_tokens": 2}
    assert_error(httpx.post(f"{url}/v1/completions", json=body), 401)
    assert_error(httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic sekret"}), 401)
    ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200  # liveness probes stay open
    assert httpx.get(f"{url}/ping").status_code == 200
    for path in ("/metrics", "/ui/stats", "/no-such-route"):  # everything else but the docs needs the key
        assert_error(httpx.get(f"{url}{path}"), 401)
    assert httpx.get(f"{url}/openapi.json").status_code == 200  # no data (issue 31: usable in a browser)
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_queue_full_gives_429_with_retry_after(guarded_server):
    url = guarded_server.url
    hosted = guarded_server.host.models["llama"]
    headers = {"Authorization": "Bearer sekret"}
    long_body = {"model": "llama", "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=long_body) as running:  # takes the one seat
            assert wait_for(lambda: hosted.num_running == 1)
            with client.stream("POST", "/v1/completions", json=long_body) as waiting:  # fills the queue
                assert waiting.status_code == 200
                assert wait_for(lambda: hosted.num_waiting == 1)
                refused = client.post("/v1/completions", json={"model": "llama", "prompt": "x", "max_tokens": 2})
                error = assert_error(refused, 429)
                assert int(refused.headers["Retry-After"]) >= 1
                assert "waiting" in error["message"]
                refused_chat = client.post(
                    "/v1/chat/completions", json={"model": "llama", "messages": [{"role": "user", "content": "x"}]}
                )
                assert_error(refused_chat, 429)
            assert running.status_code == 200
    # Both streams were abandoned: their requests are aborted and the pool drains.
    pool = hosted.engine.block_pool
    assert wait_for(lambda: pool.num_used_blocks == 0 and hosted.num_waiting == 0 and hosted.num_running == 0)
    ok = httpx.post(f"{url}/v1/completions", json={"model": "llama", "prompt": "x", "max_tokens": 2}, headers=headers)
    assert ok.status_code == 200


def test_health_is_503_while_loading(checkpoints):
    release = threading.Event()

    def factory() -> AsyncEngine:
        assert release.wait(30)
        config = HostConfig(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8, max_num_seqs=2)
        return AsyncEngine(build_engines([ModelSpec("m", checkpoints["llama"])], config))

    app = create_app(host_factory=factory)
    with serve(app, wait_ready=False) as url:
        assert_error(httpx.get(f"{url}/health"), 503)
        assert_error(httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}), 503)
        release.set()
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=30)
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200


def test_load_failure_is_reported(tmp_path):
    failures = []

    def factory() -> AsyncEngine:
        raise ValueError("no such model on disk")

    app = create_app(host_factory=factory, on_load_failed=failures.append)
    with serve(app, wait_ready=False) as url:
        assert wait_for(lambda: failures, timeout=5)
        error = assert_error(httpx.get(f"{url}/health"), 503)
        assert "no such model" in error["message"]
    time.sleep(0)
