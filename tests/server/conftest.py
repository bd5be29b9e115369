"""Fixtures for the server tests: tiny checkpoints, multi-model hosts, real uvicorn servers.

Servers listen on 127.0.0.1 with an ephemeral port, run in a thread, and are always shut
down (which also stops their engines' step thread).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from qserve.engine.async_engine import AsyncEngine, HostConfig, ModelSpec, build_engines
from qserve.server.app import create_app
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

MAX_MODEL_LEN = 256
NUM_PAGES = 96


@dataclass
class RunningServer:
    url: str
    app: object
    host: AsyncEngine | None

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@contextlib.contextmanager
def serve(app, *, wait_ready: bool = True, timeout: float = 30.0) -> Iterator[str]:
    """Run ``app`` under uvicorn on 127.0.0.1:<ephemeral> in a thread; yield its URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            assert thread.is_alive(), "uvicorn exited during start-up"
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        if wait_ready:
            while httpx.get(f"{url}/health").status_code != 200:
                assert time.monotonic() < deadline, "server did not become ready"
                time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        assert not thread.is_alive(), "uvicorn did not shut down"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Two different tiny models (different KV shapes, so pages are sized by the larger)."""
    llama = make_tiny_model("LlamaForCausalLM", seed=0)
    qwen = make_tiny_model("Qwen2ForCausalLM", seed=1, num_key_value_heads=1, num_hidden_layers=3)
    return {
        "llama": str(save_tiny_checkpoint(llama, tmp_path_factory.mktemp("llama"))),
        "qwen": str(save_tiny_checkpoint(qwen, tmp_path_factory.mktemp("qwen"))),
    }


def host_config(**overrides) -> HostConfig:
    values = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_PAGES, max_num_seqs=8)
    values.update(overrides)
    return HostConfig(**values)


@pytest.fixture(scope="session")
def two_model_server(checkpoints) -> Iterator[RunningServer]:
    """``llama`` and ``qwen`` on one shared page pool, no API key, no queue bound."""
    specs = [ModelSpec("llama", checkpoints["llama"]), ModelSpec("qwen", checkpoints["qwen"])]
    host = AsyncEngine(build_engines(specs, host_config()))
    app = create_app(host)
    with serve(app) as url:
        yield RunningServer(url, app, host)


@pytest.fixture(scope="session")
def guarded_server(checkpoints) -> Iterator[RunningServer]:
    """One model with an API key, one seat and a queue of one."""
    engines = build_engines([ModelSpec("llama", checkpoints["llama"])], host_config(max_num_seqs=1))
    host = AsyncEngine(engines, max_queue=1)
    app = create_app(host, api_key="sekret")
    with serve(app) as url:
        yield RunningServer(url, app, host)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
