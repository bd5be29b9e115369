"""A refused request leaves nothing behind, and request fields cannot reach past their purpose
(bugs found in review: a half-queued batch, a 500 on echo, a client-supplied chat template)."""

from __future__ import annotations

import httpx
import pytest

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.server.app import create_app
from tests.server.conftest import host_config, serve, wait_for
from tests.server.test_errors import assert_error


@pytest.fixture(scope="module")
def small_pool_server(checkpoints):
    """64 tokens of KV in all (4 pages), while max_model_len is 256."""
    host = AsyncEngine(build_engines([ModelSpec("llama", checkpoints["llama"])], host_config(num_kv_blocks=4)))
    with serve(create_app(host)) as url:
        yield url, host


def test_a_refused_batch_queues_none_of_its_prompts(small_pool_server):
    url, host = small_pool_server
    engine = host.models["llama"].engine
    body = {"model": "llama", "prompt": [[1, 2, 3], [5] * 100], "max_tokens": 60, "ignore_eos": True}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body, timeout=30), 400, "prompt")
    assert "can never fit" in error["message"]
    assert wait_for(lambda: engine.block_pool.num_used_blocks == 0 and not engine.has_unfinished_requests())


def test_echo_with_an_out_of_range_token_id_is_a_400(small_pool_server):
    url, _ = small_pool_server
    body = {"model": "llama", "prompt": [1, 2**40], "echo": True, "max_tokens": 2}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body, timeout=30), 400, "prompt")
    assert "vocabulary" in error["message"]


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "add_generation_prompt"])
def test_chat_template_kwargs_cannot_replace_the_template(small_pool_server, key):
    url, _ = small_pool_server
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "chat_template_kwargs": {key: "{{ 'x' * 50000000 }}"},
    }
    error = assert_error(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30), 400, "chat_template_kwargs")
    assert key in error["message"]


def test_chat_template_kwargs_still_pass_template_variables(small_pool_server):
    url, _ = small_pool_server
    body = {
        "model": "llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_a_stream_closed_before_its_first_byte_still_aborts():
    """If the response is closed before the SSE generator ever ran, the generator's own
    ``finally`` never runs; the body wrapper must still abort the engine request."""
    import asyncio

    from qserve.server.serving import ClosingStream

    aborted = []

    async def chunks():
        try:
            yield "data: {}\n\n"
        finally:
            aborted.append("generator")

    async def close_unstarted():
        body = ClosingStream(chunks(), lambda: aborted.append("on_close"))
        await body.aclose()

    asyncio.run(close_unstarted())
    assert aborted == ["on_close"]  # the unstarted generator's finally did not run; on_close did
