"""A front end whose adapter list lives in an engine core in its own process (``lora_version``,
``lora_adapters``, ``refresh_loras``: ``EngineCoreClient``'s interface) follows an adapter another
front end loaded on EVERY route that takes a model name, not only the generation routes:
``/tokenize`` and ``/detokenize`` find it, and a completion with it gets its base model's sampling
defaults (``generation_config.json``) whether or not the core's news has arrived yet.

The host is an in-process ``AsyncEngine`` given that interface (no processes): "another front end
loads" = the adapter registered on the engine and listed by the fake core; "the news arrived" =
``lora_version`` bumped; "not yet" = only ``refresh_loras`` (a round trip to the core) brings it.
"""

from __future__ import annotations

import httpx
import pytest

from qserve.engine.async_engine import AsyncEngine, ModelSpec, build_engines
from qserve.lora.request import LoRARequest
from qserve.server.app import create_app
from tests.helpers.lora_adapters import projection_shapes, write_peft_adapter
from tests.server.conftest import host_config, serve

SHAPES = projection_shapes(64, 128, 4, 2, 16)  # tests/helpers/tiny_models.py's Llama


@pytest.fixture
def core_like(checkpoints, tmp_path):
    """(url, host, load): a server over a host shaped like an engine-core client; ``load(news)``
    loads the adapter ``extra`` as another front end would, ``news``: whether its LoRAState
    already reached this front end."""
    write_peft_adapter(tmp_path / "extra", SHAPES, 2, targets=("q_proj", "v_proj"), rank=8, alpha=16, seed=3)
    engines = build_engines([ModelSpec("llama", checkpoints["llama"])], host_config(enable_lora=True, max_loras=2))
    host = AsyncEngine(engines)
    listed: list[LoRARequest] = []
    pending: list[LoRARequest] = []
    host.lora_version = 0
    host.lora_adapters = lambda: list(listed)

    async def refresh_loras() -> list[LoRARequest]:  # the core's answer carries its whole list
        if pending:
            listed.extend(pending)
            pending.clear()
            host.lora_version += 1
        return list(listed)

    host.refresh_loras = refresh_loras
    host.models["llama"].sampling_defaults = {"max_tokens": 3}  # as from the base's generation_config.json

    def load(news: bool) -> None:
        request = LoRARequest("extra", 1, str(tmp_path / "extra"), "llama")
        engines["llama"].add_lora(request)
        if news:
            listed.append(request)
            host.lora_version += 1
        else:
            pending.append(request)

    app = create_app(host, log_stats=False, ui=False)
    with serve(app) as url:
        yield url, host, load


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, headers={"Connection": "close"})


@pytest.mark.parametrize("news", [True, False], ids=["news-arrived", "news-not-yet"])
def test_tokenize_finds_an_adapter_another_front_end_loaded(core_like, news):
    url, _, load = core_like
    load(news)
    tokens = _post(url, "/tokenize", {"model": "extra", "prompt": "hello"})
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == _post(url, "/tokenize", {"model": "llama", "prompt": "hello"}).json()["tokens"]
    text = _post(url, "/detokenize", {"model": "extra", "tokens": tokens.json()["tokens"]})
    assert text.status_code == 200, text.text


@pytest.mark.parametrize("news", [True, False], ids=["news-arrived", "news-not-yet"])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_an_adapter_another_front_end_loaded_gets_its_bases_sampling_defaults(core_like, news, route):
    url, _, load = core_like
    load(news)
    body = {"model": "extra", "temperature": 0, "ignore_eos": True}
    body |= {"prompt": [5, 9, 33]} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    reply = _post(url, f"/v1/{route}", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3  # the base's max_tokens default, not the server's


def test_add_lora_takes_the_id_from_the_cores_answer(monkeypatch):
    """The core's answer to a load carries its whole adapter list; the id comes from it, not from the
    client's copy, which news of a later unload by another front end may already have changed
    before the loading coroutine resumes (it raised KeyError: a 500)."""
    import asyncio

    from qserve.engine.core.client import EngineCoreClient
    from qserve.engine.core.messages import LoRASpec, LoRAState
    from qserve.lora.request import LoRARequest

    client = object.__new__(EngineCoreClient)
    client._loras = {}  # the later unload's news, applied first

    async def control(message):  # noqa: ANN001, ANN202
        return LoRAState([LoRASpec("sql", 7, "/adapters/sql", "llama")], control_id=1)

    monkeypatch.setattr(client, "get_model", lambda model: None, raising=False)
    monkeypatch.setattr(client, "_control", control, raising=False)
    assert asyncio.run(client.add_lora("llama", LoRARequest("sql", 1, "/adapters/sql"))) == 7
